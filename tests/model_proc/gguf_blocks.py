"""GGUF blocks for the quantized-kernel tests (test_quant_kernels.py,
test_quant_dot.py): random and converter-written blocks, gguf-py's
dequantization as the reference, and the native ops' AVX2/scalar switch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from model_proc import native
from model_proc.quant.ggml_types import GGMLType, block_shape, fp16_fields


def random_blocks(qtype: GGMLType, n: int, k: int, seed: int, subnormal: bool = True) -> np.ndarray:
    """uint8 [n, row_bytes]: random bytes (every code, 6-bit scale and bit
    pattern occurs), the fp16 scales overwritten with finite values of both
    signs, some of them zero (and, with `subnormal`, some subnormal)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = block_shape(qtype)
    raw = rng.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    for off in fp16_fields(qtype):
        scales = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        scales.flat[::17] = 0.0
        if subnormal:
            scales.flat[5::23] = np.float16(3e-6)  # subnormal in fp16
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def quantized_blocks(qtype: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes] as a converter writes them: gguf-py quantizing random floats."""
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType(qtype))


def gguf_reference(blocks: np.ndarray, qtype: GGMLType) -> torch.Tensor:
    """gguf-py's dequantization of `blocks`: float32 [n, k]."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as its bit patterns: equal only when bit for bit (-0.0 is not 0.0)."""
    return t.contiguous().view(torch.int32)


def on_native_path(op: Any, name: str, path: str) -> Iterator[str]:
    """A fixture's body: the native op `name` on its AVX2 path ("simd", where
    this build has it) or its scalar one, switched back to AVX2 after."""
    if op is None:
        pytest.skip(f"native {name} op not built: {native.failure(name)}")
    if path == "simd" and not op.simd():
        pytest.skip("this build has no AVX2 path")
    op.set_simd(path == "simd")
    try:
        yield path
    finally:
        op.set_simd(True)
