"""The native backend: the C++ op of model_proc/native/ (CPU), composed with
the torch backend for what the op does not run."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from collections.abc import Sequence

from common.messages import ForwardMode
from model_proc.attention.base import AttentionBackend, AttentionMetadata, LayerAttention
from model_proc.attention.torch_backend import TorchAttnBackend
from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.step_inputs import StepInputs

logger = logging.getLogger(__name__)


@dataclass
class NativeAttnMetadata(AttentionMetadata):
    """Rows the op attends: it reads K/V in place through kv_indices, so it
    needs no padded slot matrix; `max_len` is the longest row (decode)."""
    max_len: int = 0
    # extend rows of a sliding layer: the torch backend's metadata for the
    # same rows (the op has no window mask), built by the first such layer
    torch_meta: AttentionMetadata | None = None


@dataclass
class MixedAttnMetadata(AttentionMetadata):
    """A mixed step: its extend rows' metadata (the op's or the torch
    backend's; None when every row decodes) and its decoding rows' (the
    op's); the decoding rows' tokens
    start at `decode_token`. `inputs` is the whole step's (the model reads
    qo_indptr to find each row's last token)."""
    extend: AttentionMetadata | None = None
    decode: NativeAttnMetadata | None = None
    decode_token: int = 0


class NativeAttnBackend(AttentionBackend):
    """The C++ op of model_proc/native/ (CPU): decode (and extend, see
    native_extend) reads K/V in place through kv_indices, with no gather into
    a padded buffer and no per-row Python loop; the query heads of a KV head
    go together (GQA); the KV store is fused into the op.

    It holds a torch backend (`self.torch`) for the rest: extend rows where
    the op's extend is off, and every step where the op is missing (no
    compiler, a failed build: logged once by native.load) or has no kernel for
    this dtype or head_dim (logged here). Which one attends a step is decided
    once, in init_forward_metadata, and read back from the metadata's type.
    With the op, the pool's memory is advised onto transparent huge pages
    (native.advise_huge_pages: faster decode on scattered slots, measured by
    bench/micro/attention_bench.py).
    """

    # Which path extend rows take: the op's (True), the torch backend's
    # (False), or None (the default): the op's where its products run on the
    # matrix units (bfloat16 with AMX or AVX512_BF16, head_dim a multiple of
    # 32), torch's elsewhere. The op's bfloat16 extend (every key block packed
    # once per call, both products through brgemm, base-2 online softmax,
    # rescaled lazily) beats the torch path there at every prefix length
    # (bench/RESULTS.md, "Prefill over a cached prefix"); its float32 extend
    # (SIMD dot products) is slower than the torch path's.
    native_extend: bool | None = None

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(kv_pool, req_to_token, scale, layers)
        from model_proc import native  # imported here: only this backend builds it

        self.torch = TorchAttnBackend(kv_pool, req_to_token, scale, layers)
        k_buf = kv_pool.k_buffer[0]
        dtype, head_dim = str(kv_pool.dtype).removeprefix("torch."), k_buf.shape[2]
        self.op = native.load() if k_buf.device.type == "cpu" else None
        if self.op is not None and any(spec.softcap is not None for spec in self.layers):
            logger.warning("native attention op has no soft-capped scores: using the torch attention path")
            self.op = None
        elif self.op is not None and not self.op.supports(dtype, head_dim):
            logger.warning("native attention op has no kernel for %s, head_dim %d: using the torch "
                           "attention path", dtype, head_dim)
            self.op = None
        elif k_buf.device.type != "cpu":
            logger.warning("native attention op runs on CPU only: using the torch attention path on %s",
                           k_buf.device)
        if self.native_extend is None:  # the class default: decided here, per pool
            self.native_extend = self.op is not None and self.op.extend_on_matrix_units(dtype, head_dim)
        if kv_pool.int8:  # the op decodes an int8 pool; extend rows take the torch path, which dequantizes
            self.native_extend = False
        if self.op is not None:
            # the pool's pages are untouched until their slots are written
            # (KVPool allocates with torch.empty), so they come in as huge pages
            for buf in kv_pool.k_buffer + kv_pool.v_buffer:
                native.advise_huge_pages(buf)

    def init_forward_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        if self.op is None:
            return self.torch.init_forward_metadata(inputs)
        inputs.kv_indices  # gathered here, once per step, rather than by the first layer
        if inputs.is_decode:
            return NativeAttnMetadata(inputs, max_len=inputs.max_seq_len)
        if inputs.mode is ForwardMode.VERIFY and not self.native_extend:
            # a few tokens a row over a long prefix: decode rows, one per token,
            # beat the torch extend path (bench/RESULTS.md, speculative decoding)
            rows = inputs.as_token_rows()
            rows.kv_indices  # gathered once here, as for a decode step
            return NativeAttnMetadata(rows, max_len=rows.max_seq_len)
        if not inputs.mode.is_mixed():
            return self._extend_metadata(inputs)
        # a mixed step: its decoding rows take the decode kernel, not the
        # extend path's
        extend, decode = inputs.split(inputs.batch_size - inputs.decode_rows)
        return MixedAttnMetadata(inputs, extend=None if extend is None else self._extend_metadata(extend),
                                 decode=NativeAttnMetadata(decode, max_len=decode.max_seq_len),
                                 decode_token=0 if extend is None else extend.num_tokens)

    def _extend_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        return NativeAttnMetadata(inputs) if self.native_extend else self.torch.init_forward_metadata(inputs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        if not isinstance(meta, MixedAttnMetadata):
            return self._attend(None, q, k, v, layer_id, meta)
        # the extend rows' tokens come first, the decoding rows' after them;
        # the op writes each part's rows of `out` in place (narrow, not
        # slicing: fewer dispatches)
        assert meta.decode is not None
        if meta.extend is None:
            return self._attend(None, q, k, v, layer_id, meta.decode)
        out = q.new_empty(q.shape)
        t = meta.decode_token
        for start, n, part in ((0, t, meta.extend), (t, q.shape[0] - t, meta.decode)):
            o = out.narrow(0, start, n)
            res = self._attend(o, q.narrow(0, start, n), k.narrow(0, start, n), v.narrow(0, start, n), layer_id, part)
            if res is not o:  # the torch backend's own tensor
                o.copy_(res)
        return out

    def _attend(self, out: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one kind of rows (decode or extend) into `out` (a new
        tensor when None, or where the torch backend takes them)."""
        if not isinstance(meta, NativeAttnMetadata):
            return self.torch.forward(q, k, v, layer_id, meta)
        assert self.op is not None
        window = self.layers[layer_id].window
        if window is not None and not meta.is_decode:
            # the op's extend has no window mask: the torch path's masked extend
            if meta.torch_meta is None:
                meta.torch_meta = self.torch.init_forward_metadata(meta.inputs)
            return self.torch.forward(q, k, v, layer_id, meta.torch_meta)
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        # the op needs each token's heads contiguous (a row stride of its own is fine)
        q, k, v = _heads_contiguous(q), _heads_contiguous(k), _heads_contiguous(v)
        if out is None:
            out = q.new_empty(q.shape)
        # the op stores k/v into their slots first (KVPool.store, fused), and
        # extend reads the new tokens back from the pool
        if meta.is_decode:
            # a sliding layer: each row's last `window` slots (the op stores
            # the new token first, the last of them)
            kv = meta if window is None else self.layer_window_kv(meta, layer_id)
            loc = self.layer_slots(meta, layer_id, "out", meta.out_cache_loc)
            if self.kv_pool.int8:
                return self.op.decode_int8(out, q, k_buf, v_buf, self.kv_pool.k_scale[layer_id],
                                           self.kv_pool.v_scale[layer_id], kv.kv_indptr, kv.kv_indices, self.scale,
                                           kv.max_len, k, v, loc)
            return self.op.decode(out, q, k_buf, v_buf, kv.kv_indptr, kv.kv_indices, self.scale, kv.max_len,
                                  k, v, loc)
        return self.op.extend(out, q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, self.scale,
                              k, v, meta.out_cache_loc)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads contiguous (any row stride)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
