"""Attention over the paged KV pool.

The model sees only the interface (base.py); `create_attention_backend`
builds one of: `torch` (torch_backend.py: any device; the CPU one), `native`
(native.py: the C++/OpenMP op of model_proc/native/, which reads the pool in
place; the torch path where it cannot be built), `triton` (triton_backend.py:
kernels/ on a CUDA device). `--deterministic` takes batch_invariant.py's
backend instead of `torch`.
"""

from __future__ import annotations

from model_proc.attention.base import AttentionBackend, AttentionMetadata
from model_proc.attention.batch_invariant import BatchInvariantAttnBackend
from model_proc.attention.native import NativeAttnBackend
from model_proc.attention.torch_backend import TorchAttnBackend
from model_proc.attention.triton_backend import TritonAttnBackend
from model_proc.kv_cache import KVPool, ReqToTokenTable

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend"]


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenTable,
                             scale: float, deterministic: bool = False) -> AttentionBackend:
    if deterministic:
        if name != "torch":
            raise ValueError("--deterministic needs --attention-backend torch "
                             f"(the {name} kernels split the KV by batch size)")
        return BatchInvariantAttnBackend(kv_pool, req_to_token, scale)
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token, scale)
    if name == "native":
        return NativeAttnBackend(kv_pool, req_to_token, scale)
    if name == "triton":
        return TritonAttnBackend(kv_pool, req_to_token, scale)
    raise ValueError(f"attention backend {name!r} is not available")
