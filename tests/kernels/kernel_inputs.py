"""Random inputs for the kernel tests: a scattered KV pool and ragged rows."""

from __future__ import annotations

import torch

# relative error bound against the float32 torch reference
REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def random_pool(gen: torch.Generator, slots: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k_buffer, v_buffer [slots + 1, kv_heads, head_dim], random everywhere
    (stale data in unused slots must not leak into any row)."""
    return (randn(gen, slots + 1, kv_heads, head_dim, dtype=dtype),
            randn(gen, slots + 1, kv_heads, head_dim, dtype=dtype))


def ragged_pages(gen: torch.Generator, lens: list[int], pool_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr, kv_indices (int64) for rows of `lens` tokens on distinct,
    scattered slots 1..pool_slots."""
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    indices = torch.randperm(pool_slots, generator=gen)[:sum(lens)] + 1
    return indptr, indices


def shuffled(gen: torch.Generator, items: list) -> list:
    return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, logit_cap: float) -> torch.Tensor:
    """One query token against the keys it sees, spelled out: q [Hq, D],
    k/v [L, Hkv, D] -> [Hq, Dv], float32. The oracle for windows and caps."""
    group = q.shape[0] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), k) * scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def extend_oracle(q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor, k_buf: torch.Tensor,
                  v_buf: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, scale: float, sliding_window: int, logit_cap: float) -> torch.Tensor:
    """Query by query: the token at position i (prefix + index among the new
    tokens) attends to positions max(0, i - window + 1)..i of prefix + new."""
    out = torch.empty(q.shape[0], q.shape[1], v_ext.shape[2])
    for row in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[row]), int(qo_indptr[row + 1])
        slots = kv_indices[kv_indptr[row]:kv_indptr[row + 1]].long()
        k, v = torch.cat([k_buf[slots], k_ext[q0:q1]]), torch.cat([v_buf[slots], v_ext[q0:q1]])
        for t in range(q1 - q0):
            i = slots.numel() + t
            lo = max(0, i - sliding_window + 1) if sliding_window > 0 else 0
            out[q0 + t] = attend(q[q0 + t], k[lo:i + 1], v[lo:i + 1], scale, logit_cap)
    return out
