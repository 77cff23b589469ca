"""Split-KV GQA decode attention (Triton interpreter) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd, decode_attention_ref
from tests.kernels.kernel_inputs import REL_TOL, random_pool, ragged_pages, randn, rel_err, shuffled

POOL = 1024
KV_HEADS = 2  # more than one, so that the head -> KV-head mapping is exercised


def run_decode(gen: torch.Generator, lens: list[int], group: int, head_dim: int,
               dtype: torch.dtype, splits: list[int]) -> None:
    k_buf, v_buf = random_pool(gen, POOL, KV_HEADS, head_dim, dtype)
    kv_indptr, kv_indices = ragged_pages(gen, lens, POOL)
    q = randn(gen, len(lens), KV_HEADS * group, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    ref = decode_attention_ref(q.float(), k_buf.float(), v_buf.float(), kv_indptr, kv_indices, scale)
    for num_splits in splits:
        o = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, scale, num_splits)
        err = rel_err(o, ref)
        assert err < REL_TOL[dtype], f"lens {lens} splits {num_splits}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_mixed_batch(group: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    # one ragged batch with every length; 4 splits leave a length-1 row with
    # three empty splits, 1 split walks the 300-token row in one program
    lens = shuffled(gen, [1, 7, 96, 300])
    run_decode(gen, lens, group, head_dim, dtype, splits=[1, 4])


@pytest.mark.parametrize("lens", [[1, 1, 1], [7, 7], [96], [300]], ids=["len1", "len7", "len96", "len300"])
def test_decode_uniform_lengths(lens: list[int], gen: torch.Generator) -> None:
    run_decode(gen, lens, group=4, head_dim=64, dtype=torch.float32, splits=[3, 16])


def test_num_kv_splits_is_a_bounded_power_of_two() -> None:
    cpu = torch.device("cpu")
    for bs, heads, max_len in [(1, 1, 1), (1, 8, 4096), (64, 8, 4096), (3, 2, 300)]:
        s = choose_num_kv_splits(bs, heads, max_len, cpu)
        assert s >= 1 and s & (s - 1) == 0 and s <= 16
        assert s == 1 or max_len // s >= 64  # no split shorter than 64 tokens
