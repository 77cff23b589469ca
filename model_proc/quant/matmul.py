"""y = x @ W.T with W's GGUF blocks as they are stored, no float copy of W kept.

Few rows (decode): the native gemv (model_proc/native/quant.cpp), which
dequantizes each block in registers and reads the weight once. More rows
(prefill): W dequantized a tile of rows at a time (bounded memory) and
multiplied by torch's float32 matmul, whose blocking beats the gemv's once
x's rows are many. Without the native module (it cannot build here) the tiles
come from dequantize_torch, and every M takes the tiled path.
"""

from __future__ import annotations

import torch

from model_proc import native
from model_proc.quant.dequant import check_blocks, dequantize_torch
from model_proc.quant.ggml_types import GGMLType

# Up to this many rows of x the native gemv; above, dequantized tiles and torch.mm.
# The gemv's time grows ~linearly with x's rows (one FMA per weight and row
# after the weight's decode), the tiles' cost starts at the dequantization's.
# One thread (median ms, random Q4_0 / Q4_K / Q8_0 blocks, 2026-12-06):
#   8192 x 2048, rows  1: gemv 1.3,  tiles  4.4-5.7   (float32 F.linear 2.5-3.1)
#                     16: gemv 12.1-12.7, tiles 15.2-18.4
#                     32: gemv 24.7-25.6, tiles 20.9-25.4
#   2048 x 8192, rows 16: gemv 12.7-13.4, tiles 13.8-14.7; 32: 29-31 vs 19-21
#   1536 x 512,  rows 16: gemv 0.48-0.60, tiles 0.55-0.58; 32: 1.2-1.3 vs 0.8
GEMV_MAX_ROWS = 16
# float32 elements of one dequantized tile (4 MiB; tried 0.25-16 MiB: 4 was
# best or within 5% at 32 and 200 rows): bounds the temporary memory
TILE_ELEMENTS = 1 << 20
_X_DTYPES = (torch.float32, torch.bfloat16)


def _op():  # -> the native module or None
    return native.load(name="quant")


def dequantize(blocks: torch.Tensor, qtype: GGMLType, k: int) -> torch.Tensor:
    """float32 [N, k] from a weight's blocks uint8 [N, row_bytes], bit for bit
    gguf-py's dequantize: the native op where it builds, else torch."""
    qtype = check_blocks(blocks, qtype, k)
    op = _op()
    if op is None:
        return dequantize_torch(blocks, qtype, k)
    return op.dequantize(blocks, int(qtype), k)


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLType, k: int) -> torch.Tensor:
    """x @ dequantize(W).T: [M, N] in x's dtype, from x [M, k] (float32 or
    bfloat16) and W's blocks uint8 [N, row_bytes] of `qtype`. Computed in
    float32 (a bfloat16 x is widened, the result rounded once)."""
    if x.dtype not in _X_DTYPES or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 or bfloat16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    op = _op()
    xf = x.float().contiguous()  # itself when it already is
    if op is not None and x.shape[0] <= GEMV_MAX_ROWS:
        # the op checks the blocks (type, bytes a row) itself: a decode step
        # makes hundreds of these calls, each python check costs ~1 us
        y = op.gemv(xf, blocks, int(qtype))
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    qtype = check_blocks(blocks, qtype, k)
    m, n = x.shape[0], blocks.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    rows = max(1, min(n, TILE_ELEMENTS // k))
    tile = torch.empty(rows, k) if op is not None else None
    for n0 in range(0, n, rows):
        part = blocks[n0:n0 + rows]
        if op is not None:
            w = op.dequantize(part, int(qtype), k, out=tile[:part.shape[0]])
        else:
            w = dequantize_torch(part, qtype, k)
        out[:, n0:n0 + part.shape[0]] = torch.mm(xf, w.t())
    return out
