"""The batching study's per-mode timelines: read from a real server's GET /timeline
before it stops, saved as JSON and PNG on one time axis, and shown in the report."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from bench.serving import batching_study as study
from bench.plots import study_plots
from bench.lib import study_report
from bench.serving.bench_serving import load_client_tokenizer
from bench.plots.timeline_plot import build_rows, load_events, span
from tests.scheduler.test_scheduler import Harness

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def recorded(n: int, max_new: int) -> list[dict]:
    h = Harness(max_running=8, max_total_tokens=1000)
    for i in range(n):
        h.submit(f"r{i}", n_prompt=4, max_new=max_new)
    h.run_until_idle()
    return list(h.sched.timeline.events)


def test_every_mode_is_drawn_on_the_longest_modes_time_axis(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(study_plots, "plot_timeline",
                        lambda events, path, title, xlim=None: drawn.update({os.path.basename(path): xlim}))
    timelines = {"continuous": recorded(3, 4), "serial": recorded(3, 40), "static": []}
    saved = study_plots.save_timelines(timelines, "chapter", str(tmp_path), draw=True)
    assert [s["mode"] for s in saved] == ["continuous", "serial"]  # a mode without events is skipped
    longest = span(timelines["serial"])
    assert drawn == {"timeline_continuous.png": pytest.approx(longest * 1.02),
                     "timeline_serial.png": pytest.approx(longest * 1.02)}
    assert not (tmp_path / "timeline_static.json").exists()


def test_study_saves_each_modes_timeline_from_its_server_and_the_report_shows_them(tiny_served_model, tmp_path):
    # one mode keeps it quick; the axis sharing is the test above
    args = study.parse_args(["--modes", "static", "--traces", "chapter", "--chapter-scale", "0.02",
                             "--input-len", "8", "--max-total-tokens", "1024", "--quiet-threshold", "1",
                             "--retries", "0", "--out-dir", str(tmp_path)])
    tokenizer = load_client_tokenizer(tiny_served_model)
    traces = study.build_traces(args, tokenizer)
    rows, runs, timelines = study.run_all(args, tiny_served_model, traces, tokenizer, str(tmp_path))
    assert [r["status"] for r in rows] == ["ok"]
    assert runs and all("timeline" not in r for r in runs)  # kept apart from the runs file
    assert set(timelines) == {"static"}
    for events in timelines.values():  # the trace's 8 requests, not the warm-up
        assert sum(e.get("event") == "arrived" for e in events) == 8
        assert sum(e.get("event") == "finished" for e in events) == 8

    saved = study_plots.save_timelines(timelines, "chapter", str(tmp_path), draw=HAVE_MPL)
    for s in saved:
        path = tmp_path / f"timeline_{s['mode']}.json"
        assert path.stat().st_size < 64 * 1024
        data = json.loads(path.read_text())
        assert data["mode"] == s["mode"] and data["trace"] == "chapter"
        assert len(build_rows(load_events(data))[0]) == 8  # timeline_plot --input reads it back
        assert s["decode_steps"] > 0 and s["mean_decode_rows"] >= 1
        if HAVE_MPL:
            assert (tmp_path / f"timeline_{s['mode']}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved[0]["max_decode_rows"] > 1  # finished rows ride along in a static batch

    results_dir = os.path.dirname(str(tmp_path))  # as RESULTS.md sits above results/
    text = study_report.report(args, ["--modes", "static"], traces, rows, "m", 1.0, [],
                               timelines=saved, link_dir=results_dir, machine_end="m")
    assert f"- **static**: {study_report.TIMELINE_CAPTIONS['static']}" in text
    if HAVE_MPL:
        assert f"![static timeline]({tmp_path.name}/timeline_static.png)" in text
    if HAVE_MPL:
        beside = study_report.report(args, [], traces, rows, "m", 1.0, [], timelines=saved,
                                     link_dir=str(tmp_path), machine_end="m")
        assert "![static timeline](timeline_static.png)" in beside
