"""Attention over the paged KV pool.

The model sees only the interface (base.py); `create_attention_backend`
builds one of: `torch` (torch_backend.py: any device; the CPU one), `native`
(native.py: the C++/OpenMP op of model_proc/native/, which reads the pool in
place; the torch path where it cannot be built), `triton` (triton_backend.py:
kernels/ on a CUDA device). `--deterministic` takes batch_invariant.py's
backend instead of `torch`.
"""

from __future__ import annotations

from collections.abc import Sequence

from model_proc.attention.base import AttentionBackend, AttentionMetadata, LayerAttention, layer_attention
from model_proc.attention.batch_invariant import BatchInvariantAttnBackend
from model_proc.attention.native import NativeAttnBackend
from model_proc.attention.torch_backend import TorchAttnBackend
from model_proc.attention.triton_backend import TritonAttnBackend
from model_proc.kv_cache import KVPool, ReqToTokenTable

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerAttention", "create_attention_backend",
           "layer_attention"]


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float,
                             deterministic: bool = False,
                             layers: Sequence[LayerAttention] | None = None) -> AttentionBackend:
    """layers: each layer's window and soft-cap (default: full attention everywhere)."""
    if deterministic:
        if name != "torch":
            raise ValueError("--deterministic needs --attention-backend torch "
                             f"(the {name} kernels split the KV by batch size)")
        if layers is not None and any(spec.window is not None or spec.softcap is not None for spec in layers):
            raise ValueError("--deterministic does not run sliding-window or soft-capped attention")
        if kv_pool.int8:
            raise ValueError("--deterministic does not read an int8 KV cache (--kv-cache-dtype int8)")
        return BatchInvariantAttnBackend(kv_pool, req_to_token, scale)
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token, scale, layers)
    if name == "native":
        return NativeAttnBackend(kv_pool, req_to_token, scale, layers)
    if name == "triton":
        return TritonAttnBackend(kv_pool, req_to_token, scale, layers)
    raise ValueError(f"attention backend {name!r} is not available")
