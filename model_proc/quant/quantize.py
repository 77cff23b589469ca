"""Float weights rounded into GGUF blocks at load (`--quantization int8`,
`int4`, `w8a8_int8` on a Hugging Face folder): Q8_0 (int8 with one float16
scale per 32 weights) and Q4_0 / Q4_1 (4 bits with a scale, and for Q4_1 a
minimum, per 32). The arithmetic is llama.cpp's reference quantizer's, in
float32 in the same order, so the blocks equal gguf-py's `quants.quantize`
bit for bit (tests/model_proc/test_quantize.py); torch does it on every core
(gguf-py's numpy takes one).

`QuantizedAtLoad` holds the blocks of a checkpoint's matmul weights by their
Hugging Face names, with the interface of `GGUFWeights`, so the model loads
either the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from model_proc.quant import QuantizedWeights
from model_proc.quant.ggml_types import GGMLType, block_shape
from model_proc.quant.weight import QuantWeight
from model_proc.weights import CheckpointReader

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per block of Q8_0, Q4_0 and Q4_1


def _blocks_of(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K a multiple of 32) as float32 blocks [N * K / 32, 32]."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"k = {k} is not a multiple of the {BLOCK}-weight block")
    return w.float().reshape(-1, BLOCK)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[B, 1] float32 -> [B, 2] uint8: the float16's bytes, little end first."""
    return x.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[B, 32] values 0..15 -> [B, 16] bytes: weight j in the low nibble of
    byte j, weight j + 16 in its high nibble (ggml's order)."""
    q = q.to(torch.uint8)
    return q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << 4)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """roundf: halves away from zero (torch.round rounds them to even)."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """d = max |x| / 127; q = roundf(x / d)."""
    b = _blocks_of(w)
    d = b.abs().amax(1, keepdim=True) / 127
    q = _round_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_fp16_bytes(d), q], 1).reshape(w.shape[0], -1)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """d = (the signed value of largest magnitude) / -8; q = x / d + 8, truncated."""
    b = _blocks_of(w)
    signed_max = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = signed_max / -8
    q = (b * _inverse(d) + 8.5).trunc().clamp(0, 15)
    return torch.cat([_fp16_bytes(d), _nibbles(q)], 1).reshape(w.shape[0], -1)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """d = (max - min) / 15, m = min; q = (x - m) / d, rounded."""
    b = _blocks_of(w)
    lo, hi = b.amin(1, keepdim=True), b.amax(1, keepdim=True)
    d = (hi - lo) / 15
    q = ((b - lo) * _inverse(d) + 0.5).trunc().clamp(0, 15)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], 1).reshape(w.shape[0], -1)


QUANTIZERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0, GGMLType.Q4_1: quantize_q4_1,
}

# --quantization's choices that quantize at load, and their blocks (w8a8_int8's
# activations are rounded too: ServerArgs.int8_activations)
AT_LOAD_TYPES: dict[str, GGMLType] = {"int8": GGMLType.Q8_0, "w8a8_int8": GGMLType.Q8_0, "int4": GGMLType.Q4_1}

# the transformer layers' matmul weights (the embedding and the head stay in
# --dtype, as SGLang's and vLLM's int8 and int4 schemes leave them)
_LAYER_MATMULS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "qkv_proj.weight",
                  "gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj.weight")


class QuantizedAtLoad(QuantizedWeights):
    """`get(hf_name)`: a layer matmul weight of the checkpoint rounded into
    `qtype` blocks, or None (not a layer matmul, or a width the blocks do not
    divide: kept in --dtype, listed in `float_types`)."""

    def __init__(self, ckpt: CheckpointReader, qtype: GGMLType) -> None:
        super().__init__()
        quantize = QUANTIZERS[qtype]
        per = block_shape(qtype)[0]
        with torch.no_grad():
            for name in ckpt.names():
                if not name.endswith(_LAYER_MATMULS) or len(ckpt.shape(name)) != 2:
                    continue
                n, k = ckpt.shape(name)
                if k % per:
                    self.float_types[name] = f"{k} columns, not whole {per}-weight blocks"
                    continue
                # one tensor at a time: the float copy is freed before the next is read
                self._weights[name] = QuantWeight.of(qtype, quantize(ckpt.read(name)).contiguous(), k)
