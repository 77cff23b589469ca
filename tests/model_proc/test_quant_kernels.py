"""The GGUF quantized-weight kernels (model_proc/quant, model_proc/native/quant.cpp):
dequantization bit for bit gguf-py's, the gemv and quant_matmul against a
float64 product of the dequantized weight, and their refusals of bad input."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from model_proc import native
from model_proc.quant import matmul
from model_proc.quant.dequant import dequantize_torch
from model_proc.quant.ggml_types import SUPPORTED, GGMLType, block_shape, row_bytes
from model_proc.quant.matmul import dequantize, quant_matmul
from tests.model_proc.gguf_blocks import bits, gguf_reference, on_native_path, quantized_blocks, random_blocks

op = native.load(name="quant")
needs_op = pytest.mark.skipif(op is None, reason=f"native quant op not built: {native.failure('quant')}")

TYPES = sorted(SUPPORTED)
N, K = 37, 512  # an odd row count (the gemv's tails), two K-quant blocks a row
# gguf-py quantizes these (the K-quants it only dequantizes)
QUANTIZABLE = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0}


def cases(qtype: GGMLType) -> list[np.ndarray]:
    found = [random_blocks(qtype, N, K, seed=int(qtype))]
    if qtype in QUANTIZABLE:
        found.append(quantized_blocks(qtype, N, K, seed=100 + int(qtype)))
    return found


@pytest.fixture(params=["simd", "scalar"])
def native_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The native op's AVX2 path (where this build has it) and its scalar one."""
    yield from on_native_path(op, "quant", request.param)


def test_block_shapes_agree_with_gguf_py_and_the_native_op() -> None:
    for qtype in TYPES:
        assert block_shape(qtype) == tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)])
        assert GGMLType(qtype).name == gguf.GGMLQuantizationType(qtype).name
        if op is not None:
            assert tuple(op.block_shape(int(qtype))) == block_shape(qtype)
    assert row_bytes(GGMLType.Q4_K, 512) == 288 and row_bytes(GGMLType.Q8_0, 64) == 68
    assert row_bytes(GGMLType.Q5_0, 640) == 440 and row_bytes(GGMLType.Q5_1, 64) == 48


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_torch_is_gguf_py_bit_for_bit(qtype: GGMLType) -> None:
    for raw in cases(qtype):
        assert torch.equal(bits(dequantize_torch(torch.from_numpy(raw), qtype, K)), bits(gguf_reference(raw, qtype)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_dequantize_is_gguf_py_bit_for_bit(qtype: GGMLType, native_path: str) -> None:
    for raw in cases(qtype):
        assert torch.equal(bits(op.dequantize(torch.from_numpy(raw), int(qtype), K)), bits(gguf_reference(raw, qtype)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_slices_of_a_weight_are_weights(qtype: GGMLType) -> None:
    """Row slices and block-aligned column slices (tensor parallelism, embedding
    rows) dequantize as the same slice of the whole, native (strided rows) and torch."""
    raw = random_blocks(qtype, N, 2 * K, seed=7)
    whole = gguf_reference(raw, qtype)
    blocks = torch.from_numpy(raw)
    half = row_bytes(qtype, K)
    for part, ref in ((blocks[:, half:], whole[:, K:]), (blocks[3:11, :half], whole[3:11, :K]),
                      (blocks[[5, 0, 5]], whole[[5, 0, 5]])):
        assert torch.equal(bits(dequantize_torch(part, qtype, ref.shape[1])), bits(ref))
        if op is not None:
            assert torch.equal(bits(op.dequantize(part, int(qtype), ref.shape[1])), bits(ref))


# The gemv sums in float32 in its own order (per chunk of 32 weights, then the
# chunk's scale; the bias/min terms through x's sums per chunk): its error
# against the float64 product is a few float32 roundings (eps 6e-8) of the
# terms' magnitudes. Bounded here by 4e-6 of sum |w| |x|: the errors measured
# are ~1e-7 of it, and a wrong weight, scale or offset is off by 1e-3 or more.
GEMV_TOL = 4e-6


def assert_close_to_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    x64, w64 = x.double(), w.double()
    scale = x64.abs() @ w64.abs().T
    err = (y.double() - x64 @ w64.T).abs()
    assert (err <= GEMV_TOL * scale + 1e-30).all(), f"max error / scale {(err / scale).max().item():.2e}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_matches_the_float64_product(qtype: GGMLType, m: int, native_path: str) -> None:
    raw = random_blocks(qtype, N, K, seed=11)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 3
    y = op.gemv(x, torch.from_numpy(raw), int(qtype))
    assert y.shape == (m, N) and y.dtype == torch.float32
    assert_close_to_product(y, x, gguf_reference(raw, qtype))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q6_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["native", "torch"])
def test_quant_matmul(qtype: GGMLType, m: int, dtype: torch.dtype, path: str,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides of the crossover (200 rows: tiles of 16 weight rows, the last
    short), on the native op and on the torch fallback; a bfloat16 x gives
    the float32 result rounded once."""
    if path == "native" and op is None:
        pytest.skip(f"native quant op not built: {native.failure('quant')}")
    if path == "torch":
        monkeypatch.setattr(matmul, "_op", lambda: None)
    monkeypatch.setattr(matmul, "TILE_ELEMENTS", 16 * K)
    raw = random_blocks(qtype, 40, K, seed=13)
    blocks, w = torch.from_numpy(raw), gguf_reference(raw, qtype)
    x = (torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 3).to(dtype)
    y = quant_matmul(x, blocks, qtype, K)
    assert y.shape == (m, 40) and y.dtype == dtype
    if dtype == torch.float32:
        assert_close_to_product(y, x, w)
    else:
        assert torch.equal(y, quant_matmul(x.float(), blocks, qtype, K).to(dtype))
    assert torch.equal(bits(dequantize(blocks, qtype, K)), bits(w))


def test_bad_input_is_refused_with_its_reason() -> None:
    blocks = torch.from_numpy(random_blocks(GGMLType.Q4_K, 4, K, seed=3))
    with pytest.raises(ValueError, match="multiple of Q4_K's 256-weight block"):
        row_bytes(GGMLType.Q4_K, 100)
    with pytest.raises(ValueError, match="unsupported GGML type 10"):
        block_shape(10)  # Q2_K
    with pytest.raises(ValueError, match="288 bytes a row; k = 256 of Q4_K needs 144"):
        dequantize_torch(blocks, GGMLType.Q4_K, 256)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_torch(blocks.view(torch.int8), GGMLType.Q4_K, K)
    with pytest.raises(ValueError, match=r"x must be float32 or bfloat16 \[M, 512\]"):
        quant_matmul(torch.zeros(2, 256), blocks, GGMLType.Q4_K, K)
    with pytest.raises(ValueError, match=r"x must be float32 or bfloat16 \[M, 512\]"):
        quant_matmul(torch.zeros(2, K, dtype=torch.float64), blocks, GGMLType.Q4_K, K)
    for m in (2, 200):  # the gemv (where the op runs: its own checks) and the tiles
        with pytest.raises(ValueError, match="unsupported GGML type 99"):
            quant_matmul(torch.zeros(m, K), blocks, 99, K)
        with pytest.raises(ValueError, match="288 bytes a row"):
            quant_matmul(torch.zeros(m, 256), blocks, GGMLType.Q4_K, 256)


@needs_op
def test_native_op_refuses_bad_input_with_its_reason() -> None:
    blocks = torch.from_numpy(random_blocks(GGMLType.Q4_K, 4, K, seed=3))
    with pytest.raises(ValueError, match="unsupported GGML type 99"):
        op.gemv(torch.zeros(1, K), blocks, 99)
    with pytest.raises(ValueError, match="k = 100 is not a positive multiple"):
        op.dequantize(blocks, int(GGMLType.Q4_K), 100)
    with pytest.raises(ValueError, match="288 bytes a row; k = 256 needs 144"):
        op.gemv(torch.zeros(1, 256), blocks, int(GGMLType.Q4_K))
    with pytest.raises(ValueError, match="contiguous float32"):
        op.gemv(torch.zeros(1, K, dtype=torch.float64), blocks, int(GGMLType.Q4_K))
    with pytest.raises(ValueError, match="uint8"):
        op.dequantize(blocks.view(torch.int8), int(GGMLType.Q4_K), K)
