"""bench/serving/sweep.py: throughput against --max-running-requests, against a real
server on a tiny random model, and its report on made-up points."""

from __future__ import annotations

import argparse
import importlib.util
import json

from bench.serving import sweep
from bench.lib.datasets import DatasetRow

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_sweep_writes_one_row_per_value_with_the_retractions_of_each(tiny_served_model, tmp_path, recorded):
    # 8 + 32 tokens a request: at most 39 KV slots each, one whole request in 64.
    # --schedule-conservativeness 0.1 makes the scheduler count on 7% of each
    # output (8 + 3 slots a request), so N = 4 runs several rows at once and they
    # outgrow the pool: retractions, however the eight requests' arrivals spread
    # over the first steps (simulated: even 24 steps apart on average). N = 1 never.
    argv = ["--model-path", tiny_served_model, "--max-running-requests", "1", "4", "--num-prompts", "8",
            "--random-input-len", "8", "--random-output-len", "32", "--max-total-tokens", "64",
            "--server-args=--schedule-conservativeness 0.1",
            "--quiet-threshold", "1", "--out-dir", str(tmp_path), "--record"] + ([] if HAVE_MPL else ["--no-plots"])
    points = sweep.main(argv)

    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert rows == json.loads(json.dumps(points))
    assert [r["max_running_requests"] for r in rows] == [1, 4]
    for r in rows:
        assert r["status"] == "ok" and r["completed"] == 8
        assert r["output_throughput"] > 0 and 0 < r["ratio_to_best"] <= 1
        assert r["retractions"] == r["retractions_logged"]  # the counter and the log lines agree
        assert r["decode_steps"] > 0 and r["decode_steps_complete"]
        assert 1 <= r["mean_running_batch"] <= r["max_running_batch"] <= r["max_running_requests"]
    assert max(r["ratio_to_best"] for r in rows) == 1
    one, four = rows
    assert one["retractions"] == 0 and one["max_running_batch"] == 1
    assert four["retractions"] > 0

    md = (tmp_path / "sweep.md").read_text()
    assert "python -m bench.serving.sweep --model-path" in md and "| 4 |" in md
    assert "about 1 whole request at once" in md
    if HAVE_MPL:
        assert "![throughput against --max-running-requests](sweep.png)" in md
        assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = recorded.check("bench.serving.sweep")  # --record
    assert record.data == rows and len(record.load_average.start) == 3


def point(n: int, tps: float, retractions: int) -> dict:
    return {"max_running_requests": n, "output_throughput": tps, "ratio_to_best": None, "ttft_p50": 10.0,
            "ttft_p99": 20.0, "itl_p50": 5.0, "retractions": retractions, "retractions_logged": retractions,
            "mean_running_batch": float(min(n, 70)), "total_output_tokens": 100, "cpu_wait": 0.1,
            "status": "ok"}


def test_a_fall_at_the_top_is_put_down_to_the_retractions_there():
    points = [point(1, 30.0, 0), point(64, 400.0, 0), point(256, 350.0, 41),
              {"max_running_requests": 512, "status": "failed: RuntimeError: boom"}]
    sweep.add_ratios(points)
    assert [p.get("ratio_to_best") for p in points] == [0.075, 1.0, 0.875, None]
    line = sweep.verdict(points, fits=73)
    assert "peaks at N = 64" in line and "N = 256" in line and "41 retractions" in line
    assert "about 73 whole requests" in line
    args = argparse.Namespace(max_total_tokens=4608, ignore_eos=False)
    text = sweep.report(args, [], points, "t", 73, "m", "m", 60.0, None, None, ".")
    assert "| 256 | 350.0 | 0.88 |" in text and "failed: RuntimeError: boom" in text
    assert "log lines agree: yes" in text

    flat = [point(1, 30.0, 0), point(64, 400.0, 0), point(256, 390.0, 0)]
    sweep.add_ratios(flat)
    assert "no retraction, so not the KV pool" in sweep.verdict(flat, fits=73)


def test_whole_requests_count_the_slots_a_request_holds():
    rows = [DatasetRow([5] * 32, 32, 32), DatasetRow([5] * 30, 30, 20)]
    assert sweep.whole_requests(rows, 4608) == 4608 // 63 == 73
