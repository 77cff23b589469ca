"""bench/micro/step_bench.py --tp-size: server rows of another tp size are cases of their own."""

from __future__ import annotations

import json

from bench.micro import step_bench
from bench.micro.step_bench import Case
from tests.bench.test_step_bench import CFG


def test_tp_server_rows_are_kept_beside_the_tp1_rows(tmp_path, monkeypatch):
    path = tmp_path / "step_bench.json"
    monkeypatch.setattr(step_bench, "RESULTS_JSON", str(path))
    floors = {"m": step_bench.Floor(CFG, bandwidth=1e9, rates={"float32": 1e9})}
    step_bench.write_json(step_bench.json_rows({Case("m", "float32", "server", 1, 8): {"ms": 10.0}}, floors))
    step_bench.write_json(step_bench.json_rows({Case("m", "float32", "server", 1, 8): {"ms": 30.0},
                                                Case("m", "float32", "forward", 1, 8): {"ms": 5.0}}, floors,
                                               tp_size=3))
    rows = json.loads(path.read_text())
    assert [(r["what"], r.get("tp_size"), r["ms_per_step"]) for r in rows] == [
        ("forward", None, 5.0), ("server", None, 10.0), ("server", 3, 30.0)]
