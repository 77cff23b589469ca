"""KV store and kv_indices build (Triton interpreter) against torch."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_ops import (build_kv_indices, build_kv_indices_ref, build_kv_indptr, store_kv,
                                  store_kv_ref)
from tests.kernels.kernel_inputs import randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kv_heads,head_dim,tokens", [(3, 64, 37), (2, 128, 5), (1, 16, 1)])
def test_store_kv_writes_only_the_given_slots(kv_heads: int, head_dim: int, tokens: int,
                                              dtype: torch.dtype, gen: torch.Generator) -> None:
    slots = 200
    k_buf = randn(gen, slots + 1, kv_heads, head_dim, dtype=dtype)
    v_buf = randn(gen, slots + 1, kv_heads, head_dim, dtype=dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    # k and v are strided views into one fused projection, as in the model
    qkv = randn(gen, tokens, (4 + 2) * kv_heads * head_dim, dtype=dtype)
    k = qkv[:, 4 * kv_heads * head_dim:5 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 5 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    loc = torch.randperm(slots, generator=gen)[:tokens] + 1
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_build_kv_indices_equals_the_table_rows(gen: torch.Generator) -> None:
    table = torch.randint(1, 10_000, (9, 2500), generator=gen, dtype=torch.int32)
    rows = torch.tensor([5, 1, 8, 3])
    lens = torch.tensor([1, 0, 2500, 1031])  # an empty row, a full one, several inner blocks
    indptr = build_kv_indptr(lens)
    assert indptr.tolist() == [0, 1, 1, 2501, 3532]
    out = build_kv_indices(table, rows, indptr, int(lens.sum()))
    assert out.dtype == torch.int64
    assert torch.equal(out, build_kv_indices_ref(table, rows, indptr))
