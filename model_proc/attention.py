"""Attention over the paged KV pool.

A backend does two things: `init_forward_metadata` once per step (index
tensors built from the ForwardBatch and `req_to_token`), and `forward` in
every layer (store the new K/V into their slots, then attend). The model sees
only this interface. Three backends: `torch` (any device; the CPU one),
`native` (CPU: the C++/OpenMP op of model_proc/native/, which reads the pool
in place; the torch path where it cannot be built) and `triton` (kernels/ on
a CUDA device; on a CPU only under TRITON_INTERPRET=1, which the tests use).
Triton is imported only when that backend is built.
`--deterministic` replaces `torch` by batch_invariant.BatchInvariantAttnBackend.

Layout of the common metadata (B rows, T new tokens):
  qo_indptr  [B+1]  row i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]]
  kv_indptr  [B+1]  row i's whole KV (prefix + new) is
  kv_indices [sum seq_lens]   kv_indices[kv_indptr[i]:kv_indptr[i+1]] (slots)
  (all index tensors are int64)
  seq_lens, prefix_lens [B]; out_cache_loc [T] (slot of every new token)
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from common.messages import ForwardBatch
from model_proc.kv_cache import KVPool, ReqToTokenTable

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    forward_mode: str  # "extend" or "decode"
    batch_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return self.forward_mode == "decode"


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> AttentionMetadata:
        """Called once per step, after the runner wrote this step's slots into
        `req_to_token`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, q_heads, D], k/v [T, kv_heads, D] of the new tokens -> [T, q_heads, D]."""


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def gather_kv_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                      kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate table[rows[i], :seq_lens[i]] over rows, without a Python loop."""
    row_of = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), seq_lens,
                                     output_size=total)
    col = torch.arange(total, device=rows.device) - kv_indptr[:-1][row_of]
    return table[rows[row_of], col].to(torch.int64)


@dataclass
class TorchAttnMetadata(AttentionMetadata):
    # extend: host copies for the per-row loop: each row's new tokens in q, and
    # the part of kv_indices holding its prefix's slots (empty: no prefix)
    qo_bounds: list[tuple[int, int]] | None = None
    prefix_bounds: list[tuple[int, int]] | None = None
    # decode: a padded [B, max_len] slot matrix (padding -> dummy slot 0) and
    # the [B, 1, 1, max_len] mask of real entries, built once, used per layer
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    max_len: int = 0


class GatherWorkspace:
    """Reused destination of the page gathers: a decode step's rows, an
    extend row's prefix.

    A fresh [rows * max_len, kv_heads, D] tensor per layer is a new large
    allocation each time, and on CPU its first touch page-faults: at batch 64
    the attention time was about 2.5x that of `index_select(out=)` into
    memory already mapped (bench/RESULTS.md). So one K and one V buffer live
    as long as the backend, grown when a step needs more; every layer and
    every step writes into them. Decode chunking bounds their size (about
    `decode_chunk_bytes`, or one row if a row is bigger); an extend needs its
    longest prefix (at most the context length).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def get(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # an inference-mode tensor cannot be written outside inference mode
        stale = self.k is not None and self.k.is_inference() and not torch.is_inference_mode_enabled()
        if self.k is None or stale or self.k.shape[0] < rows or self.k.dtype != like.dtype:
            shape = (rows, *like.shape[1:])
            self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self.v is not None
        return self.k[:rows], self.v[:rows]


class TorchAttnBackend(AttentionBackend):
    """CPU (or any device) attention with torch ops only.

    Decode has no per-request loop: the step's padded slot matrix and mask
    are built once (init_forward_metadata); each layer gathers its pages into
    the reused workspace and runs one padded, masked SDPA per chunk of rows
    (the whole batch unless it is big). Gathering every layer's pages once per
    step instead would move the same bytes (each layer's pages differ) and
    hold num_layers times the workspace; measured no faster (bench/RESULTS.md).
    """

    # K + V gathered per SDPA call. A big batch goes in chunks of rows that
    # stay in the last-level cache from the gather until SDPA reads them:
    # 20-30% less attention time at batch 64 than one batch-wide gather
    # (bench/RESULTS.md). A chunk is never less than one row.
    decode_chunk_bytes = 8 << 20

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        super().__init__(kv_pool, req_to_token, scale)
        self.workspace = GatherWorkspace()

    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> TorchAttnMetadata:
        device = out_cache_loc.device
        table = self.req_to_token.table
        bs = len(batch.seq_lens)
        rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        kv_indptr = _indptr(seq_lens)
        total_kv = sum(batch.seq_lens)
        if batch.forward_mode == "decode":
            max_len = max(batch.seq_lens)
            cols = torch.arange(max_len, device=device)
            valid = cols[None, :] < seq_lens[:, None]
            slots = table[rows, :max_len].to(torch.int64).masked_fill_(~valid, 0)
            return TorchAttnMetadata(
                forward_mode="decode", batch_size=bs,
                qo_indptr=torch.arange(bs + 1, dtype=torch.int64, device=device),
                kv_indptr=kv_indptr, kv_indices=slots[valid], seq_lens=seq_lens,
                prefix_lens=seq_lens - 1, out_cache_loc=out_cache_loc,
                decode_slots=slots.flatten(), decode_mask=valid[:, None, None, :], max_len=max_len)

        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        qo_bounds, prefix_bounds = [], []
        q0 = k0 = 0
        for s, p in zip(batch.seq_lens, batch.prefix_lens):
            qo_bounds.append((q0, q0 + s - p))
            prefix_bounds.append((k0, k0 + p))
            q0, k0 = q0 + s - p, k0 + s
        return TorchAttnMetadata(
            forward_mode="extend", batch_size=bs,
            qo_indptr=_indptr(seq_lens - prefix_lens), kv_indptr=kv_indptr,
            kv_indices=gather_kv_indices(table, rows, seq_lens, kv_indptr, total_kv),
            seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=out_cache_loc,
            qo_bounds=qo_bounds, prefix_bounds=prefix_bounds)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        self.kv_pool.store(layer_id, meta.out_cache_loc, k, v)
        if meta.is_decode:
            return self._decode(q, layer_id, meta)
        return self._extend(q, k, v, layer_id, meta)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: TorchAttnMetadata) -> torch.Tensor:
        max_len = meta.max_len
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        row_bytes = 2 * max_len * k_buf[0].numel() * k_buf.element_size()  # one row's K + V, padded
        chunk = max(1, min(meta.batch_size, self.decode_chunk_bytes // row_bytes))
        k_ws, v_ws = self.workspace.get(chunk * max_len, k_buf)
        if chunk == meta.batch_size:
            return self._decode_rows(q, k_buf, v_buf, meta.decode_slots, meta.decode_mask, k_ws, v_ws)
        out = torch.empty_like(q)
        for r0 in range(0, meta.batch_size, chunk):
            r1 = min(r0 + chunk, meta.batch_size)
            out[r0:r1] = self._decode_rows(q[r0:r1], k_buf, v_buf, meta.decode_slots[r0 * max_len:r1 * max_len],
                                           meta.decode_mask[r0:r1], k_ws, v_ws)
        return out

    def _decode_rows(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                     mask: torch.Tensor, k_ws: torch.Tensor, v_ws: torch.Tensor) -> torch.Tensor:
        """One padded, masked SDPA over rows whose flattened [rows * max_len]
        slots are given, gathered into the workspace."""
        rows, max_len = mask.shape[0], mask.shape[-1]
        k_ws, v_ws = k_ws[:slots.numel()], v_ws[:slots.numel()]
        torch.index_select(k_buf, 0, slots, out=k_ws)
        torch.index_select(v_buf, 0, slots, out=v_ws)
        # [rows, max_len, kv_heads, D] -> [rows, kv_heads, max_len, D]
        kv_heads, head_dim = k_buf.shape[1:]
        k = k_ws.view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        v = v_ws.view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        # The query heads that share a KV head (GQA) go in as that head's
        # "query positions": one [group, max_len] score matrix per KV head, K
        # and V read once, never expanded; no causal mask applies to a decode
        # token. About 1.3x faster than SDPA's enable_gqa at 64 x 256.
        group = q.shape[1] // kv_heads
        out = F.scaled_dot_product_attention(q.view(rows, kv_heads, group, head_dim), k, v,
                                             attn_mask=mask, scale=self.scale)
        return out.reshape(rows, kv_heads * group, head_dim)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        """Each row's new tokens attend to its prefix in the pool and,
        causally, to themselves.

        With a prefix, the causal mask of the new tokens over prefix + new is
        bottom-right aligned, which SDPA's CPU flash kernel cannot take as
        `is_causal` (top-left only); as an explicit mask it costs a mask read
        per score and a bool -> float conversion per layer. So the two parts
        go separately: the queries over the whole prefix with no mask, and
        over the new tokens with a plain (square) causal mask; the two partial
        results are merged by their log-sum-exp (merge_attention). The prefix
        K/V are gathered into the reused workspace (`index_select(out=)`).
        Measured (bfloat16, python -m bench.prefill_bench, bench/RESULTS.md):
        an 8192-token prompt in 256-token chunks 7.5 -> 6.5 s (whole: 5.6 s);
        one 256-token step after 7936 cached tokens 0.39 -> 0.32 s.
        """
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        out = torch.empty_like(q)
        for (q0, q1), (p0, p1) in zip(meta.qo_bounds, meta.prefix_bounds):
            # [1, heads, tokens, D]: the CPU flash kernel takes 4-d inputs only
            # (3-d ones go to the math path: 3x slower, bench/RESULTS.md)
            rq, rk, rv = (x[None, q0:q1].transpose(1, 2) for x in (q, k, v))
            if p1 == p0:  # no prefix: the new tokens are the whole row
                o = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                pk, pv = self.workspace.get(p1 - p0, k_buf)
                torch.index_select(k_buf, 0, meta.kv_indices[p0:p1], out=pk)
                torch.index_select(v_buf, 0, meta.kv_indices[p0:p1], out=pv)
                over_prefix = attention_with_lse(rq, pk[None].transpose(1, 2), pv[None].transpose(1, 2),
                                                 False, self.scale)
                over_new = attention_with_lse(rq, rk, rv, True, self.scale)
                o = merge_attention(*over_prefix, *over_new)
            out[q0:q1] = o[0].transpose(0, 1)
        return out


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hq, n, D] over k, v [B, Hkv, L, D] (GQA: Hq a
    multiple of Hkv), and each query's log-sum-exp of its scaled scores
    [B, Hq, n] (float32). `causal`: top-left aligned (query i sees keys 0..i).

    On a CPU: the flash kernel SDPA itself dispatches to, which returns the
    log-sum-exp beside the output (public SDPA does not). Elsewhere (the torch
    backend on a GPU): attention_with_lse_matmul."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return attention_with_lse_matmul(q, k, v, causal, scale)


def attention_with_lse_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse in plain float32 matmuls (the whole score matrix)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        n, length = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n, length, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp_() @ v).to(q.dtype), lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's
    output [B, H, n, D] and log-sum-exp [B, H, n]: the outputs weighted by
    each set's share of the softmax mass, exp(lse_a) / (exp(lse_a) +
    exp(lse_b)) = sigmoid(lse_a - lse_b) for set a. In float32; returns o_a's
    dtype."""
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(o_b.float(), o_a.float(), share_a).to(o_a.dtype)


class NativeAttnBackend(TorchAttnBackend):
    """The C++ op of model_proc/native/ (CPU): decode (and extend, see
    native_extend) reads K/V in place through kv_indices, with no
    gather into a padded buffer and no per-row Python loop; the query heads
    of a KV head go together (GQA); the KV store is fused into the op.

    Where the op is missing (no compiler, a failed build: logged once by
    native.load) or has no kernel for this dtype or head_dim (logged here),
    every call goes to the torch backend this class extends. With the op,
    the pool's memory is advised onto transparent huge pages
    (native.advise_huge_pages; decode at 64 x 2048 on scattered slots 288 ->
    253 ms per step, bench/attention_bench.py).
    """

    # Which path extend steps take: the op's (True), the torch path's
    # (False), or None (the default): the op's where its products run on the
    # matrix units (bfloat16 with AMX or AVX512_BF16, head_dim a multiple of
    # 32), torch's elsewhere. The op's bfloat16 extend (every key block
    # packed once per call, both products through brgemm, base-2 online
    # softmax, rescaled lazily) measured in the whole forward (python -m
    # bench.prefill_bench, bench/RESULTS.md, 2026-12-01, one run): 256 new
    # tokens after 1024 / 4096 / 7936 cached 0.107 / 0.205 / 0.318 s against
    # the torch path's 0.117 / 0.223 / 0.357, even at 0 cached. Its float32
    # extend (SIMD dot products) is slower (1024 new 10.4 vs 6.6 ms a layer).
    native_extend: bool | None = None

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        super().__init__(kv_pool, req_to_token, scale)
        from model_proc import native  # imported here: only this backend builds it

        k_buf = kv_pool.k_buffer[0]
        dtype, head_dim = str(k_buf.dtype).removeprefix("torch."), k_buf.shape[2]
        self.op = native.load() if k_buf.device.type == "cpu" else None
        if self.op is not None and not self.op.supports(dtype, head_dim):
            logger.warning("native attention op has no kernel for %s, head_dim %d: using the torch "
                           "attention path", dtype, head_dim)
            self.op = None
        elif k_buf.device.type != "cpu":
            logger.warning("native attention op runs on CPU only: using the torch attention path on %s",
                           k_buf.device)
        if self.native_extend is None:  # the class default: decided here, per pool
            self.native_extend = self.op is not None and self.op.extend_on_matrix_units(dtype, head_dim)
        if self.op is not None:
            # the pool's pages are untouched until their slots are written
            # (KVPool allocates with torch.empty), so they come in as huge pages
            for buf in kv_pool.k_buffer + kv_pool.v_buffer:
                native.advise_huge_pages(buf)

    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> AttentionMetadata:
        if self.op is None:
            return super().init_forward_metadata(batch, out_cache_loc)
        if batch.forward_mode == "decode":
            return self._decode_metadata(batch.req_pool_indices, batch.seq_lens, out_cache_loc)
        # a mixed step (--enable-mixed-chunk): its last rows are running rows
        # with one new token each; they take the decode kernel, not the
        # extend path's per-row loop
        bs, decoding = len(batch.seq_lens), 0
        while decoding < bs and batch.seq_lens[bs - 1 - decoding] - batch.prefix_lens[bs - 1 - decoding] == 1:
            decoding += 1
        if decoding == 0:
            return super().init_forward_metadata(batch, out_cache_loc)
        first = bs - decoding
        new_tokens = len(batch.input_ids) - decoding
        extend = None
        if first:
            extend = super().init_forward_metadata(
                msgspec.structs.replace(batch, req_pool_indices=batch.req_pool_indices[:first],
                                        seq_lens=batch.seq_lens[:first], prefix_lens=batch.prefix_lens[:first]),
                out_cache_loc[:new_tokens])
        decode = self._decode_metadata(batch.req_pool_indices[first:], batch.seq_lens[first:],
                                       out_cache_loc[new_tokens:])
        new_lens = torch.tensor([s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)], dtype=torch.int64)
        return MixedAttnMetadata(
            forward_mode="extend", batch_size=bs, qo_indptr=_indptr(new_lens), kv_indptr=decode.kv_indptr,
            kv_indices=decode.kv_indices, seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int64),
            prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int64), out_cache_loc=out_cache_loc,
            extend=extend, decode=decode, decode_token=new_tokens)

    def _decode_metadata(self, req_pool_indices: list[int], seq_lens_list: list[int],
                         out_cache_loc: torch.Tensor) -> TorchAttnMetadata:
        """The kv_indices alone (the op needs no padded slot matrix)."""
        device = out_cache_loc.device
        bs = len(seq_lens_list)
        rows = torch.tensor(req_pool_indices, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(seq_lens_list, dtype=torch.int64, device=device)
        kv_indptr = _indptr(seq_lens)
        return TorchAttnMetadata(
            forward_mode="decode", batch_size=bs,
            qo_indptr=torch.arange(bs + 1, dtype=torch.int64, device=device), kv_indptr=kv_indptr,
            kv_indices=gather_kv_indices(self.req_to_token.table, rows, seq_lens, kv_indptr, sum(seq_lens_list)),
            seq_lens=seq_lens, prefix_lens=seq_lens - 1, out_cache_loc=out_cache_loc,
            max_len=max(seq_lens_list))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        if not isinstance(meta, MixedAttnMetadata):
            return self._attend(None, q, k, v, layer_id, meta)
        if meta.extend is None:
            return self._attend(None, q, k, v, layer_id, meta.decode)
        # the extend rows' tokens come first, the decoding rows' after them;
        # the op writes each part's rows of `out` in place (narrow, not
        # slicing: fewer dispatches)
        out = q.new_empty(q.shape)
        t = meta.decode_token
        for start, n, part in ((0, t, meta.extend), (t, q.shape[0] - t, meta.decode)):
            o = out.narrow(0, start, n)
            res = self._attend(o, q.narrow(0, start, n), k.narrow(0, start, n), v.narrow(0, start, n), layer_id, part)
            if res is not o:  # the torch path's own tensor
                o.copy_(res)
        return out

    def _attend(self, out: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one kind of rows (decode or extend) into `out` (a new
        tensor when None, or where the torch path takes it)."""
        if self.op is None or not (meta.is_decode or self.native_extend):
            return super().forward(q, k, v, layer_id, meta)
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        # the op needs each token's heads contiguous (a row stride of its own is fine)
        q, k, v = _heads_contiguous(q), _heads_contiguous(k), _heads_contiguous(v)
        if out is None:
            out = q.new_empty(q.shape)
        # the op stores k/v into their slots first (KVPool.store, fused), and
        # extend reads the new tokens back from the pool
        if meta.is_decode:
            return self.op.decode(out, q, k_buf, v_buf, meta.kv_indptr, meta.kv_indices, self.scale, meta.max_len,
                                  k, v, meta.out_cache_loc)
        return self.op.extend(out, q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, self.scale,
                              k, v, meta.out_cache_loc)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads contiguous (any row stride)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


@dataclass
class MixedAttnMetadata(AttentionMetadata):
    """A mixed step on the native backend: the extend rows' metadata (None when
    every row decodes) and the trailing decoding rows', whose tokens start at
    `decode_token`. The shared fields describe the whole step (the model
    reads qo_indptr to find each row's last token)."""
    extend: TorchAttnMetadata | None = None
    decode: TorchAttnMetadata | None = None
    decode_token: int = 0


@dataclass
class TritonAttnMetadata(AttentionMetadata):
    # extend: the longest row's new tokens (sizes the grid), and each row's
    # prefix only (the kernel reads the new tokens from k/v, not the pool)
    max_extend_len: int = 0
    prefix_indptr: torch.Tensor | None = None
    prefix_indices: torch.Tensor | None = None
    # decode: split-KV count and the stage-1 scratch, allocated by the first
    # layer of the step (the query head count is known only there), then reused
    num_kv_splits: int = 1
    decode_scratch: tuple[torch.Tensor, torch.Tensor] | None = None


class TritonAttnBackend(AttentionBackend):
    """The kernels/ Triton kernels: KV store, on-device kv_indices build,
    split-KV GQA decode and prefix-aware extend attention."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        super().__init__(kv_pool, req_to_token, scale)
        device = kv_pool.k_buffer[0].device
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention-backend triton needs a CUDA device "
                             "(or TRITON_INTERPRET=1, the slow interpreter the tests use)")
        # imported here, not at module level: only this backend needs triton
        from kernels import decode_attention, extend_attention, kv_cache_ops
        self.decode_kernels = decode_attention
        self.extend_kernels = extend_attention
        self.kv_ops = kv_cache_ops

    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> TritonAttnMetadata:
        device = out_cache_loc.device
        table = self.req_to_token.table
        bs = len(batch.seq_lens)
        rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        kv_indptr = self.kv_ops.build_kv_indptr(seq_lens)
        kv_indices = self.kv_ops.build_kv_indices(table, rows, kv_indptr, sum(batch.seq_lens))
        if batch.forward_mode == "decode":
            num_kv_heads = self.kv_pool.k_buffer[0].shape[1]
            splits = self.decode_kernels.choose_num_kv_splits(bs, num_kv_heads, max(batch.seq_lens), device)
            return TritonAttnMetadata(
                forward_mode="decode", batch_size=bs,
                qo_indptr=torch.arange(bs + 1, dtype=torch.int64, device=device),
                kv_indptr=kv_indptr, kv_indices=kv_indices, seq_lens=seq_lens,
                prefix_lens=seq_lens - 1, out_cache_loc=out_cache_loc, num_kv_splits=splits)

        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        prefix_indptr = self.kv_ops.build_kv_indptr(prefix_lens)
        prefix_indices = self.kv_ops.build_kv_indices(table, rows, prefix_indptr, sum(batch.prefix_lens))
        return TritonAttnMetadata(
            forward_mode="extend", batch_size=bs,
            qo_indptr=self.kv_ops.build_kv_indptr(seq_lens - prefix_lens),
            kv_indptr=kv_indptr, kv_indices=kv_indices, seq_lens=seq_lens, prefix_lens=prefix_lens,
            out_cache_loc=out_cache_loc,
            max_extend_len=max(s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)),
            prefix_indptr=prefix_indptr, prefix_indices=prefix_indices)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TritonAttnMetadata) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        self.kv_ops.store_kv(k_buf, v_buf, meta.out_cache_loc, k, v)
        o = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[2])
        if meta.is_decode:
            if meta.decode_scratch is None:
                meta.decode_scratch = self.decode_kernels.decode_scratch(
                    meta.batch_size, q.shape[1], v_buf.shape[2], meta.num_kv_splits, q.device)
            return self.decode_kernels.decode_attention_fwd(
                q, k_buf, v_buf, o, meta.kv_indptr, meta.kv_indices, self.scale,
                meta.num_kv_splits, meta.decode_scratch)
        assert meta.prefix_indptr is not None and meta.prefix_indices is not None
        return self.extend_kernels.extend_attention_fwd(
            q, k, v, o, k_buf, v_buf, meta.qo_indptr, meta.prefix_indptr, meta.prefix_indices,
            meta.max_extend_len, self.scale)


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenTable,
                             scale: float, deterministic: bool = False) -> AttentionBackend:
    if deterministic:
        if name != "torch":
            raise ValueError("--deterministic needs --attention-backend torch "
                             f"(the {name} kernels split the KV by batch size)")
        # imported here: batch_invariant builds on this module
        from model_proc.batch_invariant import BatchInvariantAttnBackend
        return BatchInvariantAttnBackend(kv_pool, req_to_token, scale)
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token, scale)
    if name == "native":
        return NativeAttnBackend(kv_pool, req_to_token, scale)
    if name == "triton":
        return TritonAttnBackend(kv_pool, req_to_token, scale)
    raise ValueError(f"attention backend {name!r} is not available")
