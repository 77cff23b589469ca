"""Draw a recorded scheduler timeline as a PNG Gantt chart (matplotlib).

    python -m bench.plots.timeline_plot --url http://127.0.0.1:30000 -o timeline.png
    python -m bench.plots.timeline_plot --input timeline.json -o timeline.png

The input is what GET /timeline returns ({"events": [...]}) or just the event
list. One row per request (queued, prefilling, decoding, retracted), and the
batch size below, as the live /dashboard draws them.

Output: the PNG named by -o
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

COLORS = {"queued": "#c8c8c8", "prefill": "#f29e38", "decode": "#3b7dd8", "retracted": "#d83b3b"}


@dataclass
class RequestRow:
    rid: str
    arrived: float
    max_new_tokens: int | None = None  # as the arrival event recorded it
    segments: list[tuple[str, float, float | None]] = field(default_factory=list)  # state, start, end

    def enter(self, state: str, t: float) -> None:
        if self.segments and self.segments[-1][2] is None:
            last_state, start, _ = self.segments[-1]
            if last_state == state:
                return
            self.segments[-1] = (last_state, start, t)
        self.segments.append((state, t, None))

    def close(self, t: float) -> None:
        if self.segments and self.segments[-1][2] is None:
            state, start, _ = self.segments[-1]
            self.segments[-1] = (state, start, t)


def build_rows(events: list[dict[str, Any]]) -> tuple[list[RequestRow], list[dict[str, Any]]]:
    """Request rows (by arrival) and step events, from timeline events in time order."""
    rows: dict[str, RequestRow] = {}
    steps: list[dict[str, Any]] = []
    resuming: set[str] = set()  # re-admitted rows decode once their prefill step ends
    for e in sorted(events, key=lambda e: (e["t"], e.get("seq", 0))):
        if e["type"] == "step":
            steps.append(e)
            for rid in resuming:
                rows[rid].enter("decode", e["t"])
            resuming.clear()
            continue
        row = rows.setdefault(e["rid"], RequestRow(e["rid"], e["t"]))
        kind = e["event"]
        if kind == "arrived":
            row.max_new_tokens = e.get("max_new_tokens")
            row.enter("queued", e["t"])
        elif kind in ("admitted", "chunk"):
            row.enter("prefill", e["t"])
        elif kind == "readmitted":
            row.enter("prefill", e["t"])
            resuming.add(e["rid"])
        elif kind == "first_token":
            row.enter("decode", e["t"])
        elif kind == "retracted":
            row.enter("retracted", e["t"])
        elif kind == "finished":
            row.close(e["t"])
            resuming.discard(e["rid"])
    return sorted(rows.values(), key=lambda r: r.arrived), steps


def label(row: RequestRow) -> str:
    return row.rid[:8] + ("" if row.max_new_tokens is None else f" ({row.max_new_tokens} tok)")


def plot_timeline(events: list[dict[str, Any]], path: str, title: str = "scheduler timeline",
                  xlim: float | None = None) -> None:
    """xlim: seconds shown after the first arrival (the same for several plots
    puts them on one scale); default: the timeline's own span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, steps = build_rows(events)
    if not rows:
        raise ValueError("the timeline holds no request events")
    t0 = min(r.arrived for r in rows)
    t_end = max([e["t"] for e in events])
    fig, (gantt, batch) = plt.subplots(
        2, 1, figsize=(10, 2.0 + 0.28 * len(rows) + 1.6), sharex=True,
        gridspec_kw={"height_ratios": [max(2.0, 0.28 * len(rows)), 1.2]})
    for i, row in enumerate(rows):
        for state, start, end in row.segments:
            stop = t_end if end is None else end
            gantt.broken_barh([(start - t0, max(stop - start, 1e-3))], (i - 0.4, 0.8),
                              facecolors=COLORS[state])
    gantt.set_yticks(range(len(rows)), [label(r) for r in rows], fontsize=7)
    gantt.invert_yaxis()
    gantt.set_title(title)
    gantt.legend(handles=[Patch(color=c, label=s) for s, c in COLORS.items()],
                 loc="upper right", fontsize=7, ncol=4)
    # a step is recorded when it ends: its rows count from its start on
    xs = [e["t"] - e.get("step_time", 0.0) - t0 for e in steps]
    ys = [e["batch_size"] for e in steps]
    if steps:  # ... and until the last one ends
        xs, ys = xs + [steps[-1]["t"] - t0], ys + [ys[-1]]
    batch.step(xs, ys, where="post", color="#3b7dd8")
    batch.set_ylabel("rows in step", fontsize=8)
    batch.set_xlabel("seconds since the first arrival")
    if xlim is not None:
        batch.set_xlim(0, xlim)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_events(source: Any) -> list[dict[str, Any]]:
    return source["events"] if isinstance(source, dict) else list(source)


def fetch_timeline(base_url: str, since: float = 0.0, api_key: str = "", timeout: float = 30.0
                   ) -> dict[str, Any]:
    """GET /timeline?since=<unix time>, page after page (the server answers a
    bounded number of events a call): {"now", "seq" (events ever recorded),
    "events"}."""
    events: list[dict[str, Any]] = []
    after_seq = 0
    while True:
        req = urllib.request.Request(f"{base_url.rstrip('/')}/timeline?since={since!r}&after_seq={after_seq}")
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            page = json.load(resp)
        events += page["events"]
        after_seq = page["next_seq"]
        if not page["more"]:
            return {**page, "events": events}


def compact(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Events with times in seconds since the first one (rounded to 0.1 ms) and
    short floats, for saving: {"t0": unix time, "events": [...]}. plot_timeline
    and --input read it as they read GET /timeline's answer."""
    t0 = min((e["t"] for e in events), default=0.0)
    out = []
    for e in events:
        e = {**e, "t": round(e["t"] - t0, 4)}
        for key, digits in (("kv_usage", 4), ("step_time", 5)):
            if key in e:
                e[key] = round(e[key], digits)
        out.append(e)
    return {"t0": t0, "events": out}


def span(events: list[dict[str, Any]]) -> float:
    """Seconds from the first arrival to the last event (plot_timeline's x range)."""
    arrivals = [e["t"] for e in events if e.get("event") == "arrived"]
    return max(e["t"] for e in events) - min(arrivals) if arrivals else 0.0


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a timeline shows, in numbers: steps of each kind, rows per decode
    step (mean, max), and its span in seconds."""
    decode = [e["batch_size"] for e in events if e["type"] == "step" and e["kind"] == "decode"]
    return {
        "prefill_steps": sum(1 for e in events if e["type"] == "step" and e["kind"] != "decode"),
        "decode_steps": len(decode),
        "mean_decode_rows": sum(decode) / len(decode) if decode else None,
        "max_decode_rows": max(decode, default=None),
        "retractions": sum(1 for e in events if e.get("event") == "retracted"),
        "span_s": span(events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a JSON file saved from GET /timeline")
    src.add_argument("--url", help="a running server's base URL")
    parser.add_argument("--api-key", default="")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--title", default="scheduler timeline")
    args = parser.parse_args()
    if args.input:
        with open(args.input) as f:
            events = load_events(json.load(f))
    else:
        events = load_events(fetch_timeline(args.url, api_key=args.api_key))
    plot_timeline(events, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
