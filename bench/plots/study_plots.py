"""The batching study's figures (matplotlib, PNG, no display needed): three
summary plots, and one scheduler timeline per mode of our server.

matplotlib is optional (the `bench` extra): `have_matplotlib()` says whether
the figures can be drawn; the study writes its table (and the timelines'
JSON) either way.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Sequence

import numpy as np

from bench.plots.timeline_plot import compact, plot_timeline, span, summary
from bench.lib.utilisation import expected_utilisation, harmonic


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def throughput_by_mode(rows: Sequence[dict[str, Any]], path: str) -> None:
    """One bar group per trace; modes that did not run are marked n/a."""
    plt = pyplot()
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        sub = [r for r in rows if r["trace"] == trace]
        names = [r["mode"] for r in sub]
        values = [r["output_throughput"] or 0.0 for r in sub]
        bars = ax.bar(range(len(sub)), values, color=["#888" if v == 0 else "C0" for v in values])
        for bar, r in zip(bars, sub):
            label = "n/a" if r["output_throughput"] is None else f"{r['output_throughput']:.1f}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(sub)), names, rotation=30, ha="right")
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_title(f"trace: {trace}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def static_utilisation_vs_b(means: Sequence[float], measured: Sequence[tuple[str, int, float]], path: str,
                            seed: int = 0, max_b: int = 64) -> None:
    """Utilisation of a static batch against B: the chapter's 1/H_B, the
    sampled E[mean/max] for exponential lengths (exact, and rounded to whole
    tokens at each trace's mean), and measured points (label, B, utilisation)."""
    plt = pyplot()
    rng = np.random.default_rng(seed)
    bs = [b for b in range(1, max_b + 1)]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(bs, [1 / harmonic(b) for b in bs], "k--", label="1/H_B (chapter's approximation)")
    ax.plot(bs, [expected_utilisation(b, 1.0, rng, 4000) for b in bs], "C0-", label="E[mean/max], exponential")
    for k, mean in enumerate(dict.fromkeys(means)):
        ax.plot(bs, [expected_utilisation(b, mean, rng, 4000, rounded=True) for b in bs], ":",
                color=f"C{k + 1}", label=f"E[mean/max], whole tokens, mean {mean:g}")
    series: dict[str, list[tuple[int, float]]] = {}
    for label, b, u in measured:  # points sharing a label are one series
        series.setdefault(label, []).append((b, u))
    for k, (label, pts) in enumerate(series.items()):
        bs_, us = zip(*sorted(pts))
        text = f"{label}: {us[0]:.3f}" if len(pts) == 1 else label
        ax.plot(bs_, us, "o" if len(pts) == 1 else "s-", color=f"C{k + 3}", label=text)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("utilisation (useful / computed row-steps)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ttft_cdf(runs: Sequence[dict[str, Any]], path: str) -> None:
    """Per trace, the empirical CDF of TTFT for every mode that ran."""
    plt = pyplot()
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        for r in runs:
            if r["trace"] != trace or not r.get("ttfts"):
                continue
            t = np.sort(np.asarray(r["ttfts"])) * 1000
            ax.step(t, np.arange(1, len(t) + 1) / len(t), where="post", label=r["mode"])
        ax.set_xscale("log")  # queueing spreads TTFT over orders of magnitude
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"trace: {trace}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_all(rows: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], means: Sequence[float],
             measured: Sequence[tuple[str, int, float]], out_dir: str) -> list[str]:
    paths = [os.path.join(out_dir, n) for n in
             ("throughput_by_mode.png", "static_utilisation_vs_B.png", "ttft_cdf.png")]
    throughput_by_mode(rows, paths[0])
    static_utilisation_vs_b(means, measured, paths[1])
    ttft_cdf(runs, paths[2])
    return paths


def save_timelines(timelines: dict[str, list[dict[str, Any]]], trace: str, out_dir: str, draw: bool
                   ) -> list[dict[str, Any]]:
    """Per mode: timeline_<mode>.json (compact: times from the first event) and,
    when `draw`, timeline_<mode>.png, every PNG on the same time axis (the
    longest mode's span) so the modes compare at a glance. Returns per mode its
    files and summary() numbers."""
    kept = {mode: events for mode, events in timelines.items() if events}
    xlim = max((span(events) for events in kept.values()), default=0.0) * 1.02 or None
    saved = []
    for mode, events in kept.items():
        json_path = os.path.join(out_dir, f"timeline_{mode}.json")
        with open(json_path, "w") as f:
            json.dump({"mode": mode, "trace": trace, **compact(events)}, f, separators=(",", ":"))
        png = None
        if draw:
            png = os.path.join(out_dir, f"timeline_{mode}.png")
            plot_timeline(events, png, f"{mode} batching, trace {trace}", xlim=xlim)
        saved.append({"mode": mode, "trace": trace, "json": json_path, "png": png, **summary(events)})
    return saved
