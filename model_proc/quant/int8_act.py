"""y = x @ W.T on GGUF blocks with x quantized to 8 bits (the native module
model_proc/native/quant_dot.cpp): x's rows are rounded once to int8 blocks of
32 values with a float scale each (llama.cpp's Q8_0/Q8_1 activations), and
each weight block is dotted with them in integers.

    rows = quantize_rows(x)                  # once per x, shared by every weight x feeds
    y = matmul_q8(rows, blocks, qtype)       # float32 [M, N]
    y = quant_matmul_q8(x, blocks, qtype, k) # both, y in x's dtype

Only for the types `supports(qtype)` names (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K),
where the module builds (`available()`); the float path is
model_proc/quant/matmul.py's quant_matmul.

Speed (python -m bench.micro.quant_bench --paths gemv tiles q8 --threads 1
--clock thread --stat min; weights from memory; Zen 3 EPYC, AVX2, 2026-12-07):
against quant.cpp's float gemv and matmul.py's dequantized tiles, on a 1B
Llama's and SmolLM2-135M's shapes, the q8 kernel is the fastest of the three
at every row count from 1 to 32 for Q4_0, Q4_1, Q4_K and Q6_K: 1.2-1.9x the
gemv at 1 row, 1.4-1.9x at 4-16 rows, 1.1-1.3x the tiles at 32. Q8_0 ties
the gemv at 1 row (0.94-1.26x: both near the read-bandwidth floor) and wins
from 4 rows. So: up to 32 rows (weight.py's Q8_MAX_ROWS).

Accuracy: the result is the product of the weight with x rounded to 8 bits,
not with x. Each value moves by at most half its block's step, d / 2 with
d = max |x| / 127 over its block of 32 (plus float32 rounding of x / d,
~1e-5 of d), so

    |y - x @ W.T| <= Q8_ROUNDING * sum over blocks b of d_b * sum_{i in b} |W_i|

plus float32 summation error (a few 1e-7 of sum |x| |W|). On data of LLM
scale the error is far below that bound (errors of opposite signs cancel):
tests/model_proc/test_quant_dot.py checks the bound; the report that came
with this module has the measured errors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_proc import native
from model_proc.quant.ggml_types import GGMLType, ggml_type

# the types gemv_q8 takes
Q8_TYPES: frozenset[GGMLType] = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K,
                                           GGMLType.Q6_K})
Q8_BLOCK = 32  # x values per scale
# |x - d q| <= Q8_ROUNDING * d per value: half a step, and float32's rounding of x * (1 / d)
Q8_ROUNDING = 0.5 + 1e-5
_X_DTYPES = (torch.float32, torch.bfloat16)


class Q8Rows(NamedTuple):
    """x [M, k] quantized (quant_dot.quantize_rows): each row padded with zeros
    to kp = k rounded up to 256. q int8 [M, kp]; d float32 [M, kp / 32] the
    scales (max |x| / 127); s float32 [M, kp / 32] = d * sum(q) per block;
    bsum int16 [M, kp / 16] = sum(q) per 16 values; k the unpadded width."""
    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    bsum: torch.Tensor
    k: int

    def dequantize(self) -> torch.Tensor:
        """float32 [M, k]: q * d, the x the product is taken with (tests)."""
        m = self.q.shape[0]
        x = self.q.float().view(m, -1, Q8_BLOCK) * self.d.unsqueeze(-1)
        return x.view(m, -1)[:, :self.k]


def _op():  # -> the native module or None
    return native.load(name="quant_dot")


def available(qtype: int | None = None) -> bool:
    """Whether the native module builds here (and takes `qtype`, if given)."""
    if _op() is None:
        return False
    return qtype is None or supports(qtype)


def supports(qtype: int) -> bool:
    """Whether `qtype` is one of the types gemv_q8 takes (Q8_TYPES)."""
    try:
        return GGMLType(qtype) in Q8_TYPES
    except ValueError:
        return False


def _require_op():
    op = _op()
    if op is None:
        raise RuntimeError(f"native quant_dot op not built: {native.failure('quant_dot')}")
    return op


def quantize_rows(x: torch.Tensor) -> Q8Rows:
    """x float32 or bfloat16 [M, k] (k a multiple of 32) as 8-bit blocks."""
    if x.dtype not in _X_DTYPES or x.dim() != 2 or x.shape[1] % Q8_BLOCK or x.shape[1] == 0:
        raise ValueError(f"x must be float32 or bfloat16 [M, k] with k a positive multiple of {Q8_BLOCK}, "
                         f"got {x.dtype} {tuple(x.shape)}")
    q, d, s, bsum = _require_op().quantize_rows(x.float().contiguous())
    return Q8Rows(q, d, s, bsum, x.shape[1])


def matmul_q8(rows: Q8Rows, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 [M, N]: x @ dequantize(W).T with x as `rows` holds it and W's
    blocks uint8 [N, row_bytes] of `qtype` (one of Q8_TYPES), rows.k columns.
    The op checks the blocks (type, bytes a row) itself: a decode step makes
    hundreds of these calls."""
    return _require_op().gemv_q8(rows.q, rows.d, rows.s, rows.bsum, blocks, int(qtype), rows.k)


def quant_matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """x @ dequantize(W).T: [M, N] in x's dtype, from x float32 or bfloat16
    [M, k] and W's blocks uint8 [N, row_bytes] of `qtype`, with x quantized
    to 8-bit blocks first (see the module's accuracy note). ValueError for a
    type outside Q8_TYPES; RuntimeError where the native module is not built.
    Where one x feeds several weights (q, k, v; gate, up), quantize_rows once
    and matmul_q8 each; this does both in one native call."""
    if x.dtype not in _X_DTYPES or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 or bfloat16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if qtype not in Q8_TYPES:  # ints and GGMLTypes alike (an IntEnum hashes as its int)
        ggml_type(qtype)  # an unknown number: its own message
        raise ValueError(f"{GGMLType(qtype).name} has no 8-bit-activation kernel "
                         f"(types: {', '.join(t.name for t in sorted(Q8_TYPES))})")
    if k % Q8_BLOCK:
        raise ValueError(f"k = {k} is not a multiple of {Q8_BLOCK}")
    y = _require_op().matmul_q8(x.float().contiguous(), blocks, int(qtype))
    return y if x.dtype == torch.float32 else y.to(x.dtype)
