"""bench/plots/timeline_plot.py: request rows from a recorded timeline, and the PNG."""

from __future__ import annotations

import importlib.util

import pytest

from bench.plots.timeline_plot import build_rows, plot_timeline
from tests.scheduler.test_scheduler import Harness


def recorded_run():
    h = Harness(max_running=8, max_total_tokens=100)  # overcommits: one retraction at least
    for i in range(4):
        h.submit(f"r{i}", n_prompt=10, max_new=30)
    h.run_until_idle()
    assert h.sched.decode.total_retractions >= 1
    return list(h.sched.timeline.events)


def test_rows_follow_each_request_through_its_states():
    rows, steps = build_rows(recorded_run())
    assert [r.rid for r in rows] == ["r0", "r1", "r2", "r3"]
    assert steps and all(e["type"] == "step" for e in steps)
    for row in rows:
        states = [s for s, _, _ in row.segments]
        assert states[0] == "queued" and states[-1] == "decode"
        assert all(end is not None for _, _, end in row.segments)  # all finished
        starts = [start for _, start, _ in row.segments]
        assert starts == sorted(starts)
    retracted = [r for r in rows if any(s == "retracted" for s, _, _ in r.segments)]
    assert retracted
    for row in retracted:  # retracted, then prefilled again, then decoding again
        states = [s for s, _, _ in row.segments]
        k = states.index("retracted")
        assert states[k + 1:k + 3] == ["prefill", "decode"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (the bench extra) is not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(recorded_run(), str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
