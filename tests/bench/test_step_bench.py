"""bench/micro/step_bench.py: the floor's arithmetic (sliding layers included), the
JSON merge, and small real runs of the forward and transformers paths on the
default model and on a sliding-window model."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from bench.lib import bench_models
from bench.micro import step_bench
from bench.micro.step_bench import Case
from model_proc.model import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
                  tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=1e4,
                  rope_scaling={"rope_type": "default"})
# a tiny bench model (bench/lib/bench_models.py): 2 layers instead of 30
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=512)


@pytest.fixture
def given_rates(monkeypatch):
    """The machine's rates as constants: measuring them (a 512 MiB sum, 2048^3
    matmuls) takes seconds, and the test that records a run measures them."""
    monkeypatch.setattr(step_bench, "read_bandwidth", lambda: 20e9)
    monkeypatch.setattr(step_bench, "matmul_rate", lambda dtype: 100e9)


def test_floor_counts_weights_once_plus_the_kv_and_the_flops_of_every_row():
    floor = step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    params = 2 * per_layer + 1000 * 64
    assert floor.matmul_params() == params
    mem, comp = floor.parts_ms("float32", batch=4, context=10)
    kv = 4 * 10 * 2 * 2 * 2 * 16 * 4
    assert mem == pytest.approx(1e3 * (params * 4 + kv) / 1e9)
    assert comp == pytest.approx(1e3 * (2 * 4 * params + 4 * 4 * 10 * 2 * 4 * 16) / 1e9)
    assert floor.ms("float32", 4, 10) == max(mem, comp)


def test_the_floor_of_a_sliding_model_reads_only_the_window_of_its_sliding_layers():
    sliding = dataclasses.replace(CFG, layer_windows=(4, None))
    full, windowed = (step_bench.Floor(c, bandwidth=1e9, rates={"float32": 1e9}) for c in (CFG, sliding))
    kv_per_key = 2 * 2 * 16 * 4  # K and V, 2 kv heads of 16, float32
    for context, keys in ((3, 3 + 3), (10, 4 + 10)):  # the window holds all 3, then only 4 of 10
        mem, comp = windowed.parts_ms("float32", batch=2, context=context)
        assert mem == pytest.approx(1e3 * (windowed.matmul_params() * 4 + 2 * keys * kv_per_key) / 1e9)
        assert comp == pytest.approx(1e3 * (2 * 2 * windowed.matmul_params() + 2 * keys * 4 * 4 * 16) / 1e9)
    assert windowed.parts_ms("float32", 2, 3) == full.parts_ms("float32", 2, 3)
    assert windowed.parts_ms("float32", 2, 10)[0] < full.parts_ms("float32", 2, 10)[0]


def test_a_process_cpu_time_is_read_from_proc_as_the_process_counts_it():
    import time

    start = time.process_time()
    while time.process_time() - start < 0.2:  # busy: CPU time to read
        pass
    # /proc counts in clock ticks (10 ms); process_time() in nanoseconds
    assert abs(step_bench.process_cpu_s(os.getpid()) - time.process_time()) < 0.05


def test_a_server_row_reports_each_process_cpu_per_step(tmp_path, monkeypatch):
    floor = step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})
    model = step_bench.BenchModel("m", "m", "m", CFG)
    res = {"ms": 12.0, "forward_ms": 11.0, "outside_forward_share": 0.05,
           "cpu_ms_per_step": {"model": 23.5, "scheduler": 0.81, "front end": 0.234}}
    text = step_bench.report("cmd", [model], {"m": floor}, {Case("m", "float32", "server", 1, 8): res},
                             ["float32"], [(1, 8)], "median", (0.5, 0.5), 60.0)
    row = next(line.split(" | ") for line in text.splitlines() if line.startswith("| m | float32 |"))
    assert row[9] == "23.50 / 0.81 / 0.23"  # server CPU ms/step: model / scheduler / front end
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(tmp_path / "step_bench.json"))
    step_bench.write_json(step_bench.json_rows({Case("m", "float32", "server", 1, 8): res}, {"m": floor}))
    row = json.loads((tmp_path / "step_bench.json").read_text())[0]
    assert row["cpu_ms_per_step"] == {"model": 23.5, "scheduler": 0.81, "front end": 0.234}


def test_json_rows_replace_only_their_own_cases(tmp_path, monkeypatch):
    path = tmp_path / "step_bench.json"
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(path))
    floor = step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})
    floors = {"m": floor, "other": floor}
    step_bench.write_json(step_bench.json_rows(
        {Case("m", "float32", "forward", 1, 8): {"ms": 10.0, "attention_ms": 1.0},
         Case("m", "float32", "transformers", 1, 8): {"ms": 20.0},
         Case("other", "float32", "forward", 1, 8): {"ms": 30.0},
         Case("m", "float32", "server", 1, 8): {"skipped": "too big"}}, floors))
    step_bench.write_json(step_bench.json_rows({Case("m", "float32", "forward", 1, 8): {"ms": 12.0,
                                                                                    "attention_ms": 2.0}}, floors))
    rows = json.loads(path.read_text())
    assert [(r["model"], r["what"], r["ms_per_step"]) for r in rows] == [
        ("m", "forward", 12.0), ("m", "transformers", 20.0), ("other", "forward", 30.0)]
    f = floor.ms("float32", 1, 8)
    assert rows[0]["floor_ms"] == round(f, 3) and rows[0]["ratio_to_floor"] == round(12.0 / f, 3)
    assert rows[0]["attention_ms"] == 2.0


def test_rows_from_before_the_model_field_are_the_default_models(tmp_path, monkeypatch):
    path = tmp_path / "step_bench.json"
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(path))
    monkeypatch.setattr(step_bench, "default_label", lambda: "smol")
    old = {"dtype": "float32", "batch": 1, "context": 8, "what": "forward", "ms_per_step": 9.0,
           "floor_ms": 1.0, "ratio_to_floor": 9.0}
    path.write_text(json.dumps([old, {**old, "what": "server"}]))
    floor = step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})
    step_bench.write_json(step_bench.json_rows({Case("smol", "float32", "forward", 1, 8): {"ms": 7.0},
                                                Case("gemma", "float32", "forward", 1, 8): {"ms": 5.0}},
                                               {"smol": floor, "gemma": floor}))
    rows = json.loads(path.read_text())
    assert [(r["model"], r["what"], r["ms_per_step"]) for r in rows] == [
        ("gemma", "forward", 5.0), ("smol", "forward", 7.0), ("smol", "server", 9.0)]


def test_a_small_real_run_prints_forward_and_transformers_against_the_floor(default_model_dir, given_rates, capsys):
    step_bench.main(["--dtypes", "float32", "--what", "forward", "transformers", "--batches", "1", "2",
                     "--contexts", "8", "--steps", "1", "--no-write"])
    out = capsys.readouterr().out
    label = step_bench.default_label()
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(f"| {label} | float32 |")]
    assert [r[2:4] for r in rows] == [["1", "8"], ["2", "8"]]
    for r in rows:
        floor, forward, transformers, ratio = r[4], r[5], r[12], r[13].rstrip(" |")
        assert float(floor.split()[0]) > 0
        assert "x)" in forward and "x)" in transformers  # "ms (ratio x)" cells
        assert float(ratio) > 0
        assert r[7] == "-"  # no server in this run
    assert f"- {label}: llama, 30 layers, hidden 576, 9 q / 3 kv heads of 64" in out  # from its config


def test_a_sliding_model_steps_through_its_window_pool(default_model_dir, given_rates, tmp_path, capsys):
    """forward rows of a model whose every layer slides (a tiny mistral-like,
    window 128) at contexts inside and beyond the window; transformers' rows
    where its cache can follow."""
    folder = bench_models.ensure("mistral", str(tmp_path), default_model_dir, TINY_SHAPE)
    step_bench.main(["--model", folder, "--dtypes", "float32", "--what", "forward", "transformers",
                     "--batches", "2", "--contexts", "64", "160", "--steps", "1", "--no-write"])
    out = capsys.readouterr().out
    rows = {r[3]: r for r in (line.split(" | ") for line in out.splitlines()) if r[0] == "| mistral"}
    assert set(rows) == {"64", "160"}
    assert all("x)" in r[5] for r in rows.values())  # forward
    assert "x)" in rows["64"][12] and rows["160"][12] == "skipped"  # transformers
    assert "mistral: mistral, 2 layers (2 sliding, window 128)" in out


def test_the_forward_rows_pair_every_page_with_a_window_page(default_model_dir, tmp_path):
    folder = bench_models.ensure("gemma2", str(tmp_path), default_model_dir, TINY_SHAPE)
    runner = step_bench.make_runner("float32", batch=2, context=40, pool=96, model_path=folder)
    assert runner.window_pool_tokens == runner.max_total_tokens == 96
    slots = runner.kv_pool.window_slot[1:]
    assert sorted(slots.tolist()) == list(range(1, 97))  # every slot of the window pool, once


def test_servers_get_the_environment_the_script_was_started_with(monkeypatch):
    """The restarted script (the model process's runtime) hands the servers it
    launches the settings it changed as they were: set ones back, unset ones gone."""
    monkeypatch.setenv(step_bench.REEXEC_MARK, json.dumps({"LD_PRELOAD": "libold.so", "GOMP_SPINCOUNT": None}))
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc_minimal.so.4 libold.so")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    step_bench.restore_launch_environment()
    assert os.environ["LD_PRELOAD"] == "libold.so"
    assert "GOMP_SPINCOUNT" not in os.environ


def test_a_recorded_run_merges_its_rows_and_records_them_with_the_floors(default_model_dir, tmp_path, monkeypatch,
                                                                          recorded):
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(tmp_path / "step_bench.json"))
    step_bench.main(["--dtypes", "float32", "--what", "forward", "--batches", "2", "--contexts", "8",
                     "--steps", "1"])  # 2 x 8: one page of 16 slots
    record = recorded.check("bench.micro.step_bench")
    assert record.data == json.loads((tmp_path / "step_bench.json").read_text())
    assert [(r["model"], r["what"], r["batch"], r["context"]) for r in record.data] == [
        (step_bench.default_label(), "forward", 2, 8)]
    assert set(record.floors) == {"read_bandwidth_gbs", "matmul_float32_gflops"}
    [table] = [b for b in record.body if b.kind.value == "table"]
    assert table.rows[0][:4] == [step_bench.default_label(), "float32", "2", "8"]
