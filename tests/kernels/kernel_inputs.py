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
