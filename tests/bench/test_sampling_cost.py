"""bench/serving/sampling_cost.py: a small real run (the default model, one server)
gives one row per batch size with the three cases measured side by side, and
every json_schema answer checked."""

from __future__ import annotations

import json
import os

from bench.serving import sampling_cost


def test_a_small_run_measures_every_case_and_checks_the_json(tmp_path, recorded):
    result = sampling_cost.main(["--batches", "2", "--rounds", "1", "--output-len", "8", "--json-items", "3",
                                 "--quiet-threshold", "1", "--out-dir", str(tmp_path), "--record"])
    [row] = result["rows"]
    assert row["batch"] == 2 and row["bad_json_answers"] == 0
    for case in sampling_cost.CASES:
        assert row[f"{case}_tok_s"] > 0 and row[f"{case}_tokens"] > 0
    assert row["json_schema_ratio"] > 0 and row["penalties_ratio"] > 0
    assert json.load(open(os.path.join(tmp_path, "sampling_cost.json")))["rows"] == result["rows"]
    assert "json_schema" in open(os.path.join(tmp_path, "sampling_cost.md")).read()
    assert recorded.check("bench.serving.sampling_cost").data == result["rows"]  # --record


def test_a_json_answer_is_bad_unless_it_has_the_items():
    assert sampling_cost.check_json_answers(["[101, 202, 303]", "[1, 2]", "not json", "[1, 2, \"x\"]"], 3) == 3
