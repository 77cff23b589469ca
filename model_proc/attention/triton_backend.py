"""The Triton backend: the kernels/ package on a CUDA device (on a CPU only
under TRITON_INTERPRET=1, which the tests use). Triton is imported only when
this backend is built."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from collections.abc import Sequence

from model_proc.attention.base import AttentionBackend, AttentionMetadata, LayerAttention
from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.step_inputs import StepInputs


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

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(kv_pool, req_to_token, scale, layers)
        device = kv_pool.k_buffer[0].device
        if kv_pool.int8:
            raise ValueError("--kv-cache-dtype int8 has no Triton kernels yet: use it with the CPU's "
                             "native or torch attention backend")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention-backend triton needs a CUDA device "
                             "(or TRITON_INTERPRET=1, the slow interpreter the tests use)")
        # imported here, not at module level: only this backend needs triton
        from kernels import decode_attention, extend_attention, kv_cache_ops
        self.decode_kernels = decode_attention
        self.extend_kernels = extend_attention
        self.kv_ops = kv_cache_ops

    def init_forward_metadata(self, inputs: StepInputs) -> TritonAttnMetadata:
        table = self.req_to_token.table
        rows = inputs.req_pool_indices
        # the kernel's kv_indices, set on the inputs for every reader
        inputs.kv_indices = self.kv_ops.build_kv_indices(table, rows, inputs.kv_indptr, inputs.total_kv)
        if inputs.is_decode:
            num_kv_heads = self.kv_pool.k_buffer[0].shape[1]
            splits = self.decode_kernels.choose_num_kv_splits(inputs.batch_size, num_kv_heads, inputs.max_seq_len,
                                                              rows.device)
            return TritonAttnMetadata(inputs, num_kv_splits=splits)
        # EXTEND, and MIXED (its decoding rows are extend rows of one token here)
        prefix_indptr = self.kv_ops.build_kv_indptr(inputs.prefix_lens)
        prefix_indices = self.kv_ops.build_kv_indices(table, rows, prefix_indptr, sum(inputs.prefix_lens_host))
        return TritonAttnMetadata(inputs, max_extend_len=max(inputs.extend_lens_host),
                                  prefix_indptr=prefix_indptr, prefix_indices=prefix_indices)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TritonAttnMetadata) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        self.kv_ops.store_kv(k_buf, v_buf, self.layer_slots(meta, layer_id, "out", meta.out_cache_loc), k, v)
        o = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[2])
        spec = self.layers[layer_id]
        cap = spec.softcap or 0.0  # the kernels' "none"
        if meta.is_decode:
            if meta.decode_scratch is None:
                meta.decode_scratch = self.decode_kernels.decode_scratch(
                    meta.batch_size, q.shape[1], v_buf.shape[2], meta.num_kv_splits, q.device)
            # a sliding layer: each row's last `window` slots, no kernel change
            kv = meta if spec.window is None else self.layer_window_kv(meta, layer_id)
            return self.decode_kernels.decode_attention_fwd(
                q, k_buf, v_buf, o, kv.kv_indptr, kv.kv_indices, self.scale,
                meta.num_kv_splits, meta.decode_scratch, logit_cap=cap)
        assert meta.prefix_indptr is not None and meta.prefix_indices is not None
        return self.extend_kernels.extend_attention_fwd(
            q, k, v, o, k_buf, v_buf, meta.qo_indptr, meta.prefix_indptr,
            self.layer_slots(meta, layer_id, "prefix", meta.prefix_indices),
            meta.max_extend_len, self.scale, sliding_window=spec.window or 0, logit_cap=cap)
