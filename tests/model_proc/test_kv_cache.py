"""KV pool layout and sizing."""

from __future__ import annotations

import torch

from common.server_args import ServerArgs
from model_proc import kv_cache
from model_proc.kv_cache import KVPool, ReqToTokenTable, kv_pool_size


def test_pool_has_a_zeroed_dummy_slot_per_layer():
    pool = KVPool(10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    assert pool.k_buffer[0].shape == (11, 2, 4)
    assert all(not buf[0].any() for buf in pool.k_buffer + pool.v_buffer)
    assert pool.nbytes == 2 * 3 * 11 * 2 * 4 * 4


def test_req_to_token_table_has_an_unused_row_zero():
    table = ReqToTokenTable(num_rows=5, context_len=64, device="cpu").table
    assert table.shape == (6, 64) and table.dtype == torch.int32


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert KVPool.bytes_per_token(30, 3, 64, torch.float32) == 46080
    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == 23040


def test_pool_size_flag_wins():
    assert kv_pool_size(ServerArgs(model_path="x", max_total_tokens=777), 4096, 100) == 777


def test_pool_size_is_a_quarter_of_available_memory_capped_by_demand(monkeypatch):
    monkeypatch.setattr(kv_cache, "mem_available_bytes", lambda: 4_000_000)
    args = ServerArgs(model_path="x", max_running_requests=2)
    assert kv_pool_size(args, 100_000, 100) == 10_000  # 1 MB budget / 100 B
    assert kv_pool_size(args, 1_000, 100) == 2_000  # 2 rows x 1000 tokens is all that can be used
