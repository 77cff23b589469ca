"""Split-KV GQA decode attention (Triton interpreter) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd, decode_attention_ref
from kernels.extend_attention import extend_attention_fwd
from tests.kernels.kernel_inputs import REL_TOL, attend, random_pool, ragged_pages, randn, rel_err, shuffled

POOL = 1024
KV_HEADS = 2  # more than one, so that the head -> KV-head mapping is exercised


def run_decode(gen: torch.Generator, lens: list[int], group: int, head_dim: int,
               dtype: torch.dtype, splits: list[int], logit_cap: float = 0.0, q_scale: float = 1.0) -> None:
    """q_scale > 1 spreads the scores, so that a logit cap has something to cap."""
    k_buf, v_buf = random_pool(gen, POOL, KV_HEADS, head_dim, dtype)
    kv_indptr, kv_indices = ragged_pages(gen, lens, POOL)
    q = (randn(gen, len(lens), KV_HEADS * group, head_dim) * q_scale).to(dtype)
    scale = head_dim ** -0.5
    ref = decode_attention_ref(q.float(), k_buf.float(), v_buf.float(), kv_indptr, kv_indices, scale,
                               logit_cap=logit_cap)
    if logit_cap > 0:  # the reference against the spelled-out oracle, and the cap not a no-op
        slots = [kv_indices[kv_indptr[i]:kv_indptr[i + 1]] for i in range(len(lens))]
        oracle = torch.stack([attend(q[i], k_buf[s], v_buf[s], scale, logit_cap) for i, s in enumerate(slots)])
        uncapped = torch.stack([attend(q[i], k_buf[s], v_buf[s], scale, 0.0) for i, s in enumerate(slots)])
        assert rel_err(ref, oracle) < 1e-5
        assert rel_err(ref, uncapped) > 0.05, "the cap made no difference: the test is blind"
    for num_splits in splits:
        o = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, scale, num_splits, logit_cap=logit_cap)
        err = rel_err(o, ref)
        assert err < REL_TOL[dtype], f"lens {lens} splits {num_splits} cap {logit_cap}: relative error {err:.2e}"


# each head size and each dtype with every other case; not all four pairs (each case is
# ~0.9 s in Triton's interpreter)
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (128, torch.float16)], ids=["64-f32", "128-f16"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_mixed_batch(group: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    # one ragged batch with every length; 4 splits leave a length-1 row with
    # three empty splits, 1 split walks the 300-token row in one program
    lens = shuffled(gen, [1, 7, 96, 300])
    run_decode(gen, lens, group, head_dim, dtype, splits=[1, 4])


@pytest.mark.parametrize("lens", [[1, 1, 1], [7, 7], [96], [300]], ids=["len1", "len7", "len96", "len300"])
def test_decode_uniform_lengths(lens: list[int], gen: torch.Generator) -> None:
    run_decode(gen, lens, group=4, head_dim=64, dtype=torch.float32, splits=[3, 16])


@pytest.mark.parametrize("group", [1, 3])
def test_decode_logit_cap_squashes_scores_before_the_softmax(group: int, gen: torch.Generator) -> None:
    # scores of several units against a cap of 2; 4 splits merge capped partials
    lens = shuffled(gen, [1, 7, 96, 300])
    run_decode(gen, lens, group, head_dim=32, dtype=torch.float32, splits=[1, 4], logit_cap=2.0, q_scale=4.0)


@pytest.mark.parametrize("window", [1, 20, 64])
def test_decode_over_the_last_window_slots_equals_extend_with_that_window(window: int,
                                                                         gen: torch.Generator) -> None:
    """The decode window is the caller's: each row's kv_indices cut to its
    last `window` slots must give what extend gives its one new token with
    sliding_window=window (soft-capped in both)."""
    head_dim, group, cap = 16, 4, 3.0
    prefix = shuffled(gen, [0, 5, 70, 200])
    k_buf, v_buf = random_pool(gen, POOL, KV_HEADS, head_dim, torch.float32)
    pre_indptr, pre_indices = ragged_pages(gen, prefix, POOL)
    q = randn(gen, len(prefix), KV_HEADS * group, head_dim) * 4.0
    k, v = randn(gen, len(prefix), KV_HEADS, head_dim), randn(gen, len(prefix), KV_HEADS, head_dim)
    scale = head_dim ** -0.5
    extended = torch.full_like(q, float("nan"))
    qo_indptr = torch.arange(len(prefix) + 1, dtype=torch.int64)
    extend_attention_fwd(q, k, v, extended, k_buf, v_buf, qo_indptr, pre_indptr, pre_indices, 1, scale,
                         sliding_window=window, logit_cap=cap)

    # decode: each new token stored in a slot no prefix uses, then each row cut to its last `window`
    free = sorted(set(range(1, POOL + 1)) - set(pre_indices.tolist()))
    rows = []
    for i, slot in enumerate(free[:len(prefix)]):
        k_buf[slot], v_buf[slot] = k[i], v[i]
        rows.append(torch.cat([pre_indices[pre_indptr[i]:pre_indptr[i + 1]], torch.tensor([slot])])[-window:])
    kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(torch.tensor([r.numel() for r in rows]), 0)
    decoded = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, k_buf, v_buf, decoded, kv_indptr, torch.cat(rows), scale, 2, logit_cap=cap)
    assert rel_err(decoded, extended) < REL_TOL[torch.float32]


def test_num_kv_splits_is_a_bounded_power_of_two() -> None:
    cpu = torch.device("cpu")
    for bs, heads, max_len in [(1, 1, 1), (1, 8, 4096), (64, 8, 4096), (3, 2, 300)]:
        s = choose_num_kv_splits(bs, heads, max_len, cpu)
        assert s >= 1 and s & (s - 1) == 0 and s <= 16
        assert s == 1 or max_len // s >= 64  # no split shorter than 64 tokens
