"""Batch-invariant forward (`--deterministic`): a token's hidden states, K/V
and logits are the same bits whatever else shares its forward.

Why they differ without it (measured on this project's 2-core AVX-512 CPU,
torch 2.13, float32; bench/micro/deterministic_cost.py measures the price):

- oneDNN's packed matmul gives a row other bits at 1 row than at 2 or more
  when the reduction is long (K = 1536, the default model's down projection):
  a request decoding alone differs from the same request beside another.
  MKL's `F.linear` (the path without oneDNN) has three classes: 1, 2-3, 4+.
- the torch backend's decode is one SDPA over the batch padded to its longest
  row: a row's bits depend on the batch size and on its mates' lengths.
- an elementwise op with a transcendental function (SiLU) computes the tail of
  each inner loop with scalar code, whose last bit can differ from the
  vector code's; above 32768 elements torch splits the work between threads
  at `numel / threads`, which for an odd row count lands inside a row.
- `torch.bmm` of a batch of one matrix can take another kernel than a batch of
  two or more (seen at 7 query heads per KV head).

What this mode does instead:

- the model pads its flat token axis to a multiple of `ROW_BLOCK` rows, so
  that torch's thread split of a per-token op falls between rows (for a
  thread count that divides `ROW_BLOCK`);
- every `Linear` is run as calls of exactly `ROW_BLOCK` rows: one shape, so
  one kernel and one reduction order; a row's bits were checked not to depend
  on its place in the block or on its block mates (tests/model_proc/
  test_deterministic.py);
- attention (model_proc/attention/batch_invariant.py) walks each query's
  keys in tiles of `KV_BLOCK`, in key order, with matmuls of one shape per
  tile; a query's tiles past its own length are exact no-ops, so its result
  depends on its own keys only. Decode and extend run the same per-query computation, so a
  token gets the same bits whether it was prefilled (in one piece or in
  chunks, alone or beside other prompts) or decoded: a request recomputed
  after a retraction gets its K/V back bit for bit.

RMSNorm, rotary, the embedding, argmax and log-softmax are row-wise already
(checked, not assumed). Not covered: the Triton backend (split-KV counts
depend on the batch), and thread counts that do not divide `ROW_BLOCK`.

This module holds the row blocks (what layers.py and model.py use); it is not
attention's, so the model's layers need not import the attention package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per matmul call. 16 is the batch size the weights are packed for
# (layers.PACK_HINT_ROWS): a decode step of up to 16 rows costs one call.
ROW_BLOCK = 16


def padded_rows(n: int) -> int:
    return -(-n // ROW_BLOCK) * ROW_BLOCK


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (t itself when it has them)."""
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def in_row_blocks(fn: Callable[..., torch.Tensor], x: torch.Tensor,
                  add: torch.Tensor | None) -> torch.Tensor:
    """fn(x, add) computed as calls of exactly ROW_BLOCK rows (the last block
    zero-padded), concatenated."""
    n = x.shape[0]
    if n == ROW_BLOCK:
        return fn(x, add)
    rows = padded_rows(n)
    x = pad_rows(x, rows)
    add = None if add is None else pad_rows(add, rows)
    parts = [fn(x[r:r + ROW_BLOCK], None if add is None else add[r:r + ROW_BLOCK])
             for r in range(0, rows, ROW_BLOCK)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:n]
