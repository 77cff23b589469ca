"""The attention backends, torch, native (the C++ op) and triton (interpreter),
through the model's interface (init_forward_metadata + forward) against a
naive per-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from common.messages import ForwardBatch, ForwardMode
from model_proc.attention import AttentionBackend, create_attention_backend
from model_proc.attention.base import FULL, LayerAttention
from model_proc.kv_cache import KVPool, ReqToTokenTable
from tests.helpers import step_inputs
from tests.kernels.kernel_inputs import rel_err

Q_HEADS, KV_HEADS, HEAD_DIM, POOL = 6, 2, 16, 600
BACKENDS = ["torch", "native", "triton"]
# the torch backend's decode in chunks of rows, as a big batch runs: 1 and 2
# rows per chunk (5 rows: an uneven last chunk)
DECODE_VARIANTS = {"torch": None, "torch-chunk1": 1, "torch-chunk2": 2, "native": None, "triton": None}


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


def make_backend(name: str, gen: torch.Generator) -> AttentionBackend:
    pool = KVPool(POOL, num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  dtype=torch.float32, device="cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf[1:] = torch.randn(buf[1:].shape, generator=gen)  # stale data everywhere
    table = ReqToTokenTable(num_rows=5, context_len=400, device="cpu")
    return create_attention_backend(name, pool, table, scale=HEAD_DIM ** -0.5)


def fill_rows(backend: AttentionBackend, rows: list[int], lens: list[int], gen: torch.Generator) -> None:
    slots = (torch.randperm(POOL, generator=gen) + 1).to(torch.int32)
    used = 0
    for row, n in zip(rows, lens):
        backend.req_to_token.table[row, :n] = slots[used:used + n]
        used += n


def make_batch(mode: str, rows: list[int], seq_lens: list[int], prefix_lens: list[int],
               num_new: int) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(ForwardMode(mode), rows, seq_lens, prefix_lens, [0] * num_new, [0] * num_new,
                        [0.0] * b, [1.0] * b, [-1] * b, [0.0] * b, [-1] * b, [0] * b)


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_decode(variant: str, gen: torch.Generator) -> None:
    backend = make_backend(variant.split("-")[0], gen)
    rows, seq_lens = [3, 1, 4, 2, 5], [37, 1, 300, 5, 96]
    if DECODE_VARIANTS[variant]:
        row_bytes = 2 * max(seq_lens) * KV_HEADS * HEAD_DIM * 4
        backend.decode_chunk_bytes = DECODE_VARIANTS[variant] * row_bytes
    fill_rows(backend, rows, seq_lens, gen)
    table = backend.req_to_token.table
    loc = torch.tensor([table[r, n - 1].item() for r, n in zip(rows, seq_lens)])
    meta = backend.init_forward_metadata(step_inputs(make_batch("decode", rows, seq_lens, [], len(rows)), table, loc))
    assert meta.kv_indptr.tolist() == [0, 37, 38, 338, 343, 439]
    q = torch.randn(len(rows), Q_HEADS, HEAD_DIM, generator=gen)
    k_new = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen)
    v_new = torch.randn(len(rows), KV_HEADS, HEAD_DIM, generator=gen)
    out = backend.forward(q, k_new, v_new, layer_id=1, meta=meta)

    pool = backend.kv_pool
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = table[row, :n].long()
        assert torch.equal(meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]], slots)
        assert torch.equal(pool.k_buffer[1][slots[-1]], k_new[i])  # stored before use
        ref = naive_attention(q[i:i + 1], pool.k_buffer[1][slots], pool.v_buffer[1][slots], n - 1)
        assert rel_err(out[i], ref[0]) < 1e-5


@pytest.mark.parametrize("name", [*BACKENDS, "native-op-extend"])
def test_extend_sees_prefix_in_pool_and_is_causal(name: str, gen: torch.Generator) -> None:
    backend = make_backend(name.split("-")[0], gen)
    if name == "native-op-extend":  # the native backend leaves extend to torch unless told
        backend.native_extend = True
    rows, seq_lens, prefix_lens = [2, 4, 1, 5], [20, 6, 9, 330], [12, 0, 8, 300]
    fill_rows(backend, rows, seq_lens, gen)
    table = backend.req_to_token.table
    new_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    loc = torch.cat([table[r, p:s].long() for r, s, p in zip(rows, seq_lens, prefix_lens)])
    meta = backend.init_forward_metadata(step_inputs(make_batch("extend", rows, seq_lens, prefix_lens, sum(new_lens)),
                                                     table, loc))
    assert meta.qo_indptr.tolist() == [0, 8, 14, 15, 45]
    assert meta.kv_indptr.tolist() == [0, 20, 26, 35, 365]
    t = sum(new_lens)
    q = torch.randn(t, Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    out = backend.forward(q, k, v, layer_id=0, meta=meta)

    pool, q0 = backend.kv_pool, 0
    for i, (row, s, p, n) in enumerate(zip(rows, seq_lens, prefix_lens, new_lens)):
        slots = table[row, :s].long()
        assert torch.equal(meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]], slots)
        assert torch.equal(pool.k_buffer[0][slots[p:]], k[q0:q0 + n])
        ref = naive_attention(q[q0:q0 + n], pool.k_buffer[0][slots], pool.v_buffer[0][slots], p)
        assert rel_err(out[q0:q0 + n], ref) < 1e-5
        q0 += n


def test_triton_backend_refuses_a_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                              gen: torch.Generator) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        make_backend("triton", gen)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_a_sliding_layer_reads_and_writes_through_the_window_pool(name: str, mode: str, gen: torch.Generator) -> None:
    """Layer 1 slides (window 16) and keeps its K/V in a window pool of 128
    slots, paired with the full slots its rows' windows still see (scattered,
    page size 1; the rest unpaired): the step's output equals the same step
    over one pool, and the new tokens' K/V land in their window slots."""
    window, window_pool = 16, 128
    layers = [FULL, LayerAttention(window=window)]
    one = KVPool(POOL, num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    two = KVPool(POOL, num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu",
                 windowed=[False, True], window_size=window_pool, page_size=1)
    for buf in one.k_buffer + one.v_buffer:
        buf[1:] = torch.randn(buf[1:].shape, generator=gen)
    two.k_buffer[0].copy_(one.k_buffer[0])
    two.v_buffer[0].copy_(one.v_buffer[0])
    table = ReqToTokenTable(num_rows=5, context_len=400, device="cpu")
    if mode == "decode":
        rows, seq_lens, prefix_lens = [3, 1, 4, 2, 5], [37, 1, 300, 5, 96], [36, 0, 299, 4, 95]
    else:
        rows, seq_lens, prefix_lens = [2, 4, 1, 5], [20, 6, 9, 330], [12, 0, 8, 300]
    slots = (torch.randperm(POOL, generator=gen) + 1).to(torch.int32)
    used = 0
    for row, n in zip(rows, seq_lens):
        table.table[row, :n] = slots[used:used + n]
        used += n
    # what the rows' sliding layer sees: from its first new token's window on
    seen = torch.cat([table.table[r, max(0, p - window + 1):s].long() for r, s, p in zip(rows, seq_lens, prefix_lens)])
    paired = torch.randperm(window_pool, generator=gen)[:seen.numel()] + 1
    two.pair_pages(torch.stack([seen - 1, paired - 1], 1).view(-1).tolist())  # page = slot - 1 at page size 1
    for a, b in ((one.k_buffer[1], two.k_buffer[1]), (one.v_buffer[1], two.v_buffer[1])):
        b[paired] = a[seen]
    loc = torch.cat([table.table[r, p:s].long() for r, s, p in zip(rows, seq_lens, prefix_lens)])
    t = loc.numel()
    q = torch.randn(t, Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    outs = []
    for pool in (one, two):
        backend = create_attention_backend(name, pool, table, scale=HEAD_DIM ** -0.5, layers=layers)
        batch = make_batch(mode, rows, seq_lens, [] if mode == "decode" else prefix_lens, t)
        meta = backend.init_forward_metadata(step_inputs(batch, table.table, loc))
        outs.append(backend.forward(q, k, v, layer_id=1, meta=meta))
    assert rel_err(outs[1], outs[0]) < 1e-5
    assert torch.equal(two.k_buffer[1][two.to_window(loc)], k)
    assert torch.equal(two.v_buffer[1][two.to_window(loc)], v)
