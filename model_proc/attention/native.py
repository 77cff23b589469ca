"""The native backend: the C++ op of model_proc/native/ (CPU)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import torch

from common.messages import ForwardBatch
from model_proc.attention.base import AttentionMetadata, gather_kv_indices, indptr
from model_proc.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from model_proc.kv_cache import KVPool, ReqToTokenTable

logger = logging.getLogger(__name__)


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
            forward_mode="extend", batch_size=bs, qo_indptr=indptr(new_lens), kv_indptr=decode.kv_indptr,
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
        kv_indptr = indptr(seq_lens)
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
