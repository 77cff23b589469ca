"""Extend (prefill) attention over prefix-in-pool plus new tokens (Triton
interpreter) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from tests.kernels.kernel_inputs import REL_TOL, random_pool, ragged_pages, randn, rel_err, shuffled

POOL = 1024
# (q_heads, kv_heads) per GQA ratio: small head counts keep the interpreter's grid small
HEADS = {1: (2, 2), 3: (6, 2), 4: (4, 1)}


def run_extend(gen: torch.Generator, rows: list[tuple[int, int]], group: int, head_dim: int,
               dtype: torch.dtype) -> None:
    """rows: (new tokens, prefix tokens) per request."""
    q_heads, kv_heads = HEADS[group]
    ext_lens, pre_lens = [n for n, _ in rows], [p for _, p in rows]
    k_buf, v_buf = random_pool(gen, POOL, kv_heads, head_dim, dtype)
    kv_indptr, kv_indices = ragged_pages(gen, pre_lens, POOL)
    qo_indptr, _ = ragged_pages(gen, ext_lens, POOL)
    total = sum(ext_lens)
    q = randn(gen, total, q_heads, head_dim, dtype=dtype)
    # k/v as strided views of one fused tensor, like the model's qkv split
    kv = randn(gen, total, 2 * kv_heads, head_dim, dtype=dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    scale = head_dim ** -0.5
    o = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, max(ext_lens), scale)
    ref = extend_attention_ref(q.float(), k.float(), v.float(), k_buf.float(), v_buf.float(),
                               qo_indptr, kv_indptr, kv_indices, scale)
    err = rel_err(o, ref)
    assert err < REL_TOL[dtype], f"rows {rows}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "prefix"])
def test_extend_mixed_batch(with_prefix: bool, group: int, head_dim: int, dtype: torch.dtype,
                            gen: torch.Generator) -> None:
    new = [1, 7, 96, 300] if not with_prefix else [1, 7, 96, 130]
    prefix = [0] * 4 if not with_prefix else [300, 1, 37, 64]
    run_extend(gen, shuffled(gen, list(zip(new, prefix))), group, head_dim, dtype)


@pytest.mark.parametrize("rows", [[(1, 0)] * 3, [(7, 0), (7, 5)], [(96, 0)], [(300, 0)], [(1, 300)]],
                         ids=["len1", "len7", "len96", "len300", "prefix300"])
def test_extend_uniform_lengths(rows: list[tuple[int, int]], gen: torch.Generator) -> None:
    run_extend(gen, rows, group=4, head_dim=64, dtype=torch.float32)
