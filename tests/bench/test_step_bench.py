"""bench/micro/step_bench.py: the floor's arithmetic, the JSON merge, and one small
real run of the forward and transformers paths on the default model."""

from __future__ import annotations

import json
import os

import pytest

from bench.micro import step_bench
from model_proc.model import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
                  tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=1e4,
                  rope_scaling={"rope_type": "default"})


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


def test_json_rows_replace_only_their_own_cases(tmp_path, monkeypatch):
    path = tmp_path / "step_bench.json"
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(path))
    floor = step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})
    step_bench.write_json(step_bench.json_rows(
        {("float32", "forward", 1, 8): {"ms": 10.0, "attention_ms": 1.0},
         ("float32", "transformers", 1, 8): {"ms": 20.0},
         ("float32", "server", 1, 8): {"skipped": "too big"}}, floor))
    step_bench.write_json(step_bench.json_rows({("float32", "forward", 1, 8): {"ms": 12.0, "attention_ms": 2.0}},
                                               floor))
    rows = json.loads(path.read_text())
    assert [(r["what"], r["ms_per_step"]) for r in rows] == [("forward", 12.0), ("transformers", 20.0)]
    f = floor.ms("float32", 1, 8)
    assert rows[0]["floor_ms"] == round(f, 3) and rows[0]["ratio_to_floor"] == round(12.0 / f, 3)
    assert rows[0]["attention_ms"] == 2.0


def test_a_small_real_run_prints_forward_and_transformers_against_the_floor(default_model_dir, capsys):
    step_bench.main(["--dtypes", "float32", "--what", "forward", "transformers", "--batches", "1", "2",
                     "--contexts", "8", "--steps", "1", "--no-write"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| float32 |")]
    assert [r[1:3] for r in rows] == [["1", "8"], ["2", "8"]]
    for r in rows:
        floor, forward, transformers, ratio = r[3], r[4], r[10], r[11].rstrip(" |")
        assert float(floor.split()[0]) > 0
        assert "x)" in forward and "x)" in transformers  # "ms (ratio x)" cells
        assert float(ratio) > 0
        assert r[6] == "-"  # no server in this run


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
    assert [(r["what"], r["batch"], r["context"]) for r in record.data] == [("forward", 2, 8)]
    assert set(record.floors) == {"read_bandwidth_gbs", "matmul_float32_gflops"}
    [table] = [b for b in record.body if b.kind.value == "table"]
    assert table.rows[0][:3] == ["float32", "2", "8"]
