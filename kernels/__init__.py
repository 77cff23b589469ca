"""Triton kernels for attention over the paged KV pool, each with the torch
reference it is tested against:

  decode_attention  split-KV GQA decode (one query token per row)
  extend_attention  prefill/extend: prefix in the pool + causal new tokens
  kv_cache_ops      KV store into slots; kv_indptr/kv_indices from req_to_token
  tiling            launch helpers shared by the above
  compile_check     compile all of them for a GPU target without a GPU

Importing this package imports no Triton; the modules do, so they are
imported only by the triton attention backend
(model_proc/attention/triton_backend.py), the tests (under TRITON_INTERPRET=1
on a CPU) and tests/gpu/gpu_check.py. kernels/ imports nothing of this project's
but itself (tests/test_layering.py).
"""
