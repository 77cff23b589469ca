"""The torch attention backend against a naive per-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from common.messages import ForwardBatch, ForwardMode
from model_proc.attention.torch_backend import (TorchAttnBackend, attention_with_lse, attention_with_lse_matmul,
                                                merge_attention)
from model_proc.kv_cache import KVPool, ReqToTokenTable
from tests.helpers import step_inputs

Q_HEADS, KV_HEADS, HEAD_DIM, POOL = 6, 2, 16, 400


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [n, Hq, D] at positions first_pos.., over k/v [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        visible = first_pos + j + 1
        scores = torch.einsum("hd,lhd->hl", q[j], k[:visible]) / math.sqrt(q.shape[-1])
        out[j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:visible])
    return out


def make_backend(seed: int = 0) -> tuple[TorchAttnBackend, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(POOL, num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  dtype=torch.float32, device="cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf[1:] = torch.randn(buf[1:].shape, generator=gen)  # stale data everywhere
    table = ReqToTokenTable(num_rows=4, context_len=128, device="cpu")
    return TorchAttnBackend(pool, table, scale=HEAD_DIM ** -0.5), gen


def fill_rows(backend: TorchAttnBackend, rows: list[int], lens: list[int], gen: torch.Generator) -> None:
    slots = (torch.randperm(POOL, generator=gen) + 1).to(torch.int32)
    used = 0
    for row, n in zip(rows, lens):
        backend.req_to_token.table[row, :n] = slots[used:used + n]
        used += n


def batch(mode: str, rows: list[int], seq_lens: list[int], prefix_lens: list[int], num_new: int) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(ForwardMode(mode), rows, seq_lens, prefix_lens, [0] * num_new, [0] * num_new,
                        [0.0] * b, [1.0] * b, [-1] * b, [0.0] * b, [-1] * b, [0] * b)


def test_decode_attention_equals_naive_per_row_reference():
    backend, gen = make_backend()
    rows, seq_lens = [3, 1, 4, 2], [37, 1, 90, 5]
    fill_rows(backend, rows, seq_lens, gen)
    # the new token's slot is the last one of each row (the runner writes it so)
    loc = torch.tensor([backend.req_to_token.table[r, n - 1].item() for r, n in zip(rows, seq_lens)])
    table = backend.req_to_token.table
    meta = backend.init_forward_metadata(step_inputs(batch("decode", rows, seq_lens, [], len(rows)), table, loc))
    q = torch.randn(len(rows), Q_HEADS, HEAD_DIM, generator=gen)
    k_new = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen)
    v_new = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen)
    out = backend.forward(q, k_new, v_new, layer_id=1, meta=meta)

    pool = backend.kv_pool
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = backend.req_to_token.table[row, :n].long()
        torch.testing.assert_close(pool.k_buffer[1][slots[-1]], k_new[i])  # stored before use
        ref = naive_attention(q[i:i + 1], pool.k_buffer[1][slots], pool.v_buffer[1][slots], n - 1)
        torch.testing.assert_close(out[i], ref[0], atol=1e-5, rtol=1e-5)


def test_extend_attention_sees_prefix_in_pool_and_is_causal():
    backend, gen = make_backend(seed=1)
    rows, seq_lens, prefix_lens = [2, 4, 1], [20, 6, 9], [12, 0, 8]
    fill_rows(backend, rows, seq_lens, gen)
    new_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    loc = torch.cat([backend.req_to_token.table[r, p:s].long()
                     for r, s, p in zip(rows, seq_lens, prefix_lens)])
    meta = backend.init_forward_metadata(step_inputs(batch("extend", rows, seq_lens, prefix_lens, sum(new_lens)),
                                                     backend.req_to_token.table, loc))
    assert meta.qo_indptr.tolist() == [0, 8, 14, 15]
    assert meta.kv_indptr.tolist() == [0, 20, 26, 35]
    t = sum(new_lens)
    q = torch.randn(t, Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    out = backend.forward(q, k, v, layer_id=0, meta=meta)

    pool, q0 = backend.kv_pool, 0
    for row, s, p, n in zip(rows, seq_lens, prefix_lens, new_lens):
        slots = backend.req_to_token.table[row, :s].long()
        assert torch.equal(meta.kv_indices[meta.kv_indptr[rows.index(row)]:][:s], slots)
        ref = naive_attention(q[q0:q0 + n], pool.k_buffer[0][slots], pool.v_buffer[0][slots], p)
        torch.testing.assert_close(out[q0:q0 + n], ref, atol=1e-5, rtol=1e-5)
        q0 += n


def test_decode_padding_points_at_the_dummy_slot():
    backend, gen = make_backend()
    rows, seq_lens = [1, 2], [3, 7]
    fill_rows(backend, rows, seq_lens, gen)
    meta = backend.init_forward_metadata(step_inputs(batch("decode", rows, seq_lens, [], 2), backend.req_to_token.table,
                                                     torch.tensor([1, 2])))
    slots = meta.decode_slots.view(2, 7)
    assert slots[0, 3:].tolist() == [0, 0, 0, 0]
    assert meta.decode_mask[:, 0, 0, :].sum(-1).tolist() == seq_lens
    assert meta.kv_indices.numel() == sum(seq_lens)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] -> [1, heads, tokens, D], as the backend passes them."""
    return x[None].transpose(1, 2)


@pytest.mark.parametrize("prefix, new", [(1, 1), (33, 7), (300, 40), (5, 64)])
@pytest.mark.parametrize("sharp", [1.0, 8.0])  # 8: scores far apart, one side's mass dwarfs the other's
def test_prefix_and_causal_new_parts_merged_equal_attention_over_all_keys(prefix, new, sharp):
    gen = torch.Generator().manual_seed(prefix * 100 + new)
    q = torch.randn(new, Q_HEADS, HEAD_DIM, generator=gen) * sharp
    k = torch.randn(prefix + new, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(prefix + new, KV_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM ** -0.5
    over_prefix = attention_with_lse(heads_first(q), heads_first(k[:prefix]), heads_first(v[:prefix]),
                                     False, scale)
    over_new = attention_with_lse(heads_first(q), heads_first(k[prefix:]), heads_first(v[prefix:]), True, scale)
    out = merge_attention(*over_prefix, *over_new)[0].transpose(0, 1)
    torch.testing.assert_close(out, naive_attention(q, k, v, prefix), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_matmul_attention_with_lse_equals_the_cpu_flash_kernel(causal):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, Q_HEADS, 30, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, 30 if causal else 70, HEAD_DIM, generator=gen)
    v = torch.randn(k.shape, generator=gen)
    out, lse = attention_with_lse(q, k, v, causal, 0.3)
    ref_out, ref_lse = attention_with_lse_matmul(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    scores = q @ k.repeat_interleave(Q_HEADS // KV_HEADS, dim=1).transpose(-1, -2) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
