"""bench/micro/attention_bench.py on a tiny random model: the attention share and
its floor, and bench/lib/machine_rates.py's timing helper."""

from __future__ import annotations

import pytest
import torch

from bench.micro import attention_bench
from bench.lib.machine_rates import timed_calls


def test_floor_is_every_k_and_v_byte_read_once_and_the_share_it_would_leave(tiny_llama_dir, make_runner,
                                                                             monkeypatch):
    runner = make_runner(tiny_llama_dir, attention_backend="torch", max_total_tokens=256,
                         max_running_requests=4, context_length=64)
    attention_bench.fill_pool(runner, 4 * 32, torch.Generator().manual_seed(0))
    cfg = runner.model_config
    expected = 4 * 32 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    assert attention_bench.kv_bytes(runner, 4, 32) == expected

    # the real measurement: the backend's time is part of the step's
    step, attn = attention_bench.measure(runner, attention_bench.decode_batch(runner, 4, 32), steps=1)
    assert 0 < attn < step

    # the cells, from a known measurement
    monkeypatch.setattr(attention_bench, "measure", lambda runner, batch, steps: (0.100, 0.040))
    bandwidth = expected / 0.020  # bytes/s: the floor is 20 ms
    [cells] = attention_bench.run_cases(runner, [(4, 32, 16)], steps=1, bandwidth=bandwidth)
    # step 100 ms, attention 40 ms (40%); at its 20 ms floor: 20 / (100 - 40 + 20) = 25%
    assert cells == ["100.0", "40.0", "40%", "20.0", "25%"]
    # without a bandwidth only the measured three
    assert attention_bench.run_cases(runner, [(1, 16, 1)], steps=1) == [["100.0", "40.0", "40%"]]


def test_timed_calls_warms_up_then_takes_the_min_or_the_median(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("bench.lib.machine_rates.time.perf_counter", lambda: now[0])

    def call_taking(durations):
        it = iter(durations)
        return lambda: now.__setitem__(0, now[0] + next(it))

    # the warm-ups (100 s each) are not timed
    assert timed_calls(call_taking([100, 100, 5, 3, 4]), 3, "min", warmups=2) == 3
    assert timed_calls(call_taking([100, 5, 3, 9]), 3, "median") == 5
