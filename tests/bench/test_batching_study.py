"""bench/serving/batching_study.py's table and plots, on made-up runs (no server, no model)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench.serving import batching_study as study
from bench.lib import study_modes, study_report


def raw_run(throughput: float, ttfts: list[float], output_lens: list[int], util: float | None = None) -> dict:
    return {"output_throughput": throughput, "median_ttft_ms": 100.0, "p99_ttft_ms": 300.0,
            "median_itl_ms": 50.0, "p99_itl_ms": 90.0, "completed": len(ttfts), "failed": 0,
            "total_output_tokens": sum(output_lens), "duration": 10.0, "batch_utilisation": util,
            "ttfts": ttfts, "send_times": [0.0] * len(ttfts), "output_lens": output_lens,
            "errors": [""] * len(ttfts)}


def test_padded_modes_without_server_counters_estimate_utilisation_from_first_tokens():
    # two static batches: first tokens at ~0.2 s and ~3 s
    raw = study_modes.with_utilisation("static", raw_run(1.0, [0.2, 0.21, 3.0, 3.01], [1, 4, 2, 2]), 8)
    assert raw["batch_utilisation"] == pytest.approx((5 + 4) / (2 * 4 + 2 * 2))
    assert raw["utilisation_source"].startswith("estimated")
    raw = study_modes.with_utilisation("continuous", raw_run(1.0, [0.1], [3]), 8)
    assert raw["batch_utilisation"] == 1.0 and "construction" in raw["utilisation_source"]
    raw = study_modes.with_utilisation("static", raw_run(1.0, [0.1], [3], util=0.5), 8)
    assert raw["batch_utilisation"] == 0.5 and raw["utilisation_source"].startswith("server counters")


def test_table_has_one_object_per_mode_with_ratios_to_continuous():
    rows = [study_report.table_row("t", "static", raw_run(5.0, [0.1], [3], util=0.25), "ok"),
            study_report.table_row("t", "continuous", raw_run(20.0, [0.1], [3], util=1.0), "ok"),
            study_report.table_row("t", "hf-serve", None, "not run: no fastapi")]
    study_report.add_ratios(rows)
    assert [r["ratio_to_continuous"] for r in rows] == [0.25, 1.0, None]
    keys = {"mode", "output_throughput", "ratio_to_continuous", "utilisation", "ttft_p50", "ttft_p99",
            "itl_p50", "itl_p99"}
    assert all(keys <= set(r) for r in rows)
    json.dumps(rows)  # what batching_study.json holds
    md = study_report.markdown_table(rows, "t")
    assert "| static | 5.0 | 0.25 | 0.250 |" in md
    assert "| hf-serve | — | — | — |" in md and "not run: no fastapi" in md


def test_server_flags_per_mode():
    args = study.parse_args(["--batch-size", "4"])
    assert args.modes == list(study_modes.MODES) and args.traces == list(study.TRACES)
    assert "--max-running-requests" in (f := study_modes.our_server_flags("serial", args, "m"))
    assert f[f.index("--max-running-requests") + 1] == "1"
    f = study_modes.our_server_flags("dynamic", args, "m")
    assert f[f.index("--batching") + 1] == "dynamic" and "--batch-timeout-ms" in f
    assert f[f.index("--max-running-requests") + 1] == "4"
    with pytest.raises(SystemExit):
        study.parse_args(["--modes", "nope"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the optional `bench` extra)")
def test_plots_are_written(tmp_path):
    from bench.plots.study_plots import draw_all

    rows = [study_report.table_row("chapter", m, raw_run(t, [0.1, 0.2], [2, 3]), "ok")
            for m, t in (("static", 5.0), ("continuous", 20.0))]
    rows.append(study_report.table_row("chapter", "hf-serve", None, "not run"))
    runs = [{"trace": "chapter", "mode": "static", "ttfts": [0.1, 0.2]},
            {"trace": "chapter", "mode": "continuous", "ttfts": [0.05, 0.1]}]
    paths = draw_all(rows, runs, [16.0, 8.0], [("static (chapter)", 8, 0.24), ("sweep", 2, 0.6),
                                                ("sweep", 4, 0.45)], str(tmp_path))
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
