"""KV pool layout and sizing."""

from __future__ import annotations

import pytest
import torch

from common.server_args import ServerArgs
from model_proc import kv_cache
from model_proc.kv_cache import KVPool, ReqToTokenTable, kv_pool_size
from model_proc.weights import load_state_dict


def test_pool_has_a_zeroed_dummy_slot_per_layer():
    pool = KVPool(10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    assert pool.k_buffer[0].shape == (11, 2, 4)
    assert all(not buf[0].any() for buf in pool.k_buffer + pool.v_buffer)
    assert pool.nbytes == 2 * 3 * 11 * 2 * 4 * 4


def test_copy_slots_copies_k_and_v_of_every_layer_and_nothing_else():
    pool = KVPool(32, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    src, dst = torch.tensor([5, 6, 7]), torch.tensor([17, 18, 19])
    pool.copy_slots(src, dst)
    for b, old in zip(pool.k_buffer + pool.v_buffer, before):
        assert torch.equal(b[dst], old[src])  # bit for bit
        rest = torch.ones(33, dtype=torch.bool)
        rest[dst] = False
        assert torch.equal(b[rest], old[rest])


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


def test_mem_fraction_static_bounds_weights_plus_kv_on_the_device(monkeypatch):
    # 10 GB device, 2 GB already in use: f = 0.5 leaves 5 - 2 - 1 (weights) = 2 GB of KV
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: (8 * 10**9, 10 * 10**9))
    args = ServerArgs(model_path="x", max_running_requests=1000, mem_fraction_static=0.5)
    assert kv_pool_size(args, 100_000, 1000, weight_bytes=10**9) == 2 * 10**6
    # a GPU without the flag takes SGLang's 0.88: 8.8 - 2 - 1 = 5.8 GB
    gpu = ServerArgs(model_path="x", max_running_requests=1000, device="cuda", attention_backend="torch")
    assert kv_pool_size(gpu, 100_000, 1000, weight_bytes=10**9) == 5_800_000


def test_mem_fraction_static_too_small_for_the_weights_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: (10 * 10**9, 10 * 10**9))
    args = ServerArgs(model_path="x", mem_fraction_static=0.05)
    with pytest.raises(RuntimeError, match="raise --mem-fraction-static"):
        kv_pool_size(args, 4096, 1000, weight_bytes=10**9)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_mem_fraction_static_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        ServerArgs(model_path="x", mem_fraction_static=fraction)


def test_mem_fraction_static_from_the_command_line():
    assert ServerArgs.from_cli(["--model-path", "x", "--mem-fraction-static", "0.6"]).mem_fraction_static == 0.6
    assert ServerArgs.from_cli(["--model-path", "x"]).mem_fraction_static is None


def test_runner_counts_its_weights_in_the_fraction(tiny_llama_dir, make_runner, monkeypatch):
    """A budget that leaves exactly 300 tokens of KV once the weights are
    counted: the runner must arrive at 300 (not more: it counted the weights)."""
    probe = make_runner(tiny_llama_dir)
    weight_bytes = sum(t.numel() for t in load_state_dict(probe.model_path).values()) * 4
    bpt = KVPool.bytes_per_token(probe.model_config.num_layers, probe.model_config.num_kv_heads,
                                 probe.model_config.head_dim, torch.float32)
    total = 2 * (weight_bytes + 300 * bpt)
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: (total, total))
    runner = make_runner(tiny_llama_dir, max_total_tokens=None, mem_fraction_static=0.5, context_length=128)
    assert runner.max_total_tokens == 300
    assert runner.kv_pool.size == 300
