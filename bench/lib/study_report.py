"""The batching study's table: one object per trace and mode, ratios to
continuous batching, and the markdown written to batching_study.md (and,
when asked, recorded: bench/lib/run_record.py), which shows the per-mode timelines."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from typing import Any, Callable, Sequence

from bench.lib.run_record import RESULTS_MD, record_run
from bench.lib.study_modes import Trace
from bench.lib.utilisation import harmonic

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/

# What each mode's timeline shows (the figure: one row per request, grey queued,
# orange prefilling, blue decoding, red retracted; below, the rows computed per step).
TIMELINE_CAPTIONS = {
    "serial": "one request at a time: each waits (grey) until the one before it has finished, "
              "and every step computes one row",
    "static": "a batch is whatever had arrived when the server was free; it runs until its longest "
              "row finishes and nobody joins it, so rows that are done (bars ended) are still computed "
              "(the rows-per-step line stays up) while the rest queue",
    "dynamic": "like static, but a batch launches only when B requests wait or the timeout has passed "
               "since the first arrived; finished rows are still computed until the longest is done",
    "continuous": "every request is admitted at once and leaves the step it finishes: the rows-per-step "
                  "line falls as bars end, and the run lasts as long as the longest request",
}


def table_row(trace: str, mode: str, raw: dict[str, Any] | None, status: str,
              cpu_wait: float | None = None) -> dict[str, Any]:
    ok = raw is not None
    return {
        "mode": mode,
        "trace": trace,
        "output_throughput": raw["output_throughput"] if ok else None,
        "ratio_to_continuous": None,
        "utilisation": raw.get("batch_utilisation") if ok else None,
        "ttft_p50": raw["median_ttft_ms"] if ok else None,
        "ttft_p99": raw["p99_ttft_ms"] if ok else None,
        "itl_p50": raw["median_itl_ms"] if ok else None,
        "itl_p99": raw["p99_itl_ms"] if ok else None,
        "utilisation_source": raw.get("utilisation_source") if ok else None,
        "completed": raw["completed"] if ok else 0,
        "total_output_tokens": raw["total_output_tokens"] if ok else 0,
        "duration_s": raw["duration"] if ok else None,
        "cpu_wait": cpu_wait,  # share of the run some task waited for a CPU (contention)
        "status": status,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        cont = next((c for c in rows if c["trace"] == r["trace"] and c["mode"] == "continuous"), None)
        if cont and cont["output_throughput"] and r["output_throughput"] is not None:
            r["ratio_to_continuous"] = r["output_throughput"] / cont["output_throughput"]


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _cpu_wait(r: dict[str, Any]) -> str:
    if r.get("cpu_wait") is None:
        return "—"
    tries = r.get("attempts", 1)
    return f"{r['cpu_wait']:.0%}" + (f" (best of {tries})" if tries > 1 else "")


def markdown_table(rows: Sequence[dict[str, Any]], trace: str) -> str:
    out = ["| mode | output tok/s | ratio to continuous | utilisation | TTFT p50 ms | TTFT p99 ms "
           "| ITL p50 ms | ITL p99 ms | done | CPU wait | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["trace"] != trace:
            continue
        note = r["status"] if r["status"] != "ok" else (r["utilisation_source"] or "")
        out.append(f"| {r['mode']} | {fmt(r['output_throughput'])} | {fmt(r['ratio_to_continuous'], 2)} "
                   f"| {fmt(r['utilisation'], 3)} | {fmt(r['ttft_p50'], 0)} | {fmt(r['ttft_p99'], 0)} "
                   f"| {fmt(r['itl_p50'], 0)} | {fmt(r['itl_p99'], 0)} | {r['completed']} "
                   f"| {_cpu_wait(r)} | {note} |")
    return "\n".join(out)


def machine_line() -> str:
    import torch
    import transformers

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, load average (1/5/15 min) {load}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def link(path: str, link_dir: str) -> str:
    """path as a markdown link target from a file in link_dir."""
    return os.path.relpath(path, link_dir).replace(os.sep, "/")


def timeline_section(timelines: Sequence[dict[str, Any]], trace: str, link_dir: str) -> list[str]:
    """One line per mode on what its timeline shows, then the image."""
    if not timelines:
        return []
    parts = [f"### Timelines of the `{trace}` trace, one per mode (same time axis)", "",
             "One row per request (grey queued, orange prefilling, blue decoding, red retracted); "
             "below, the rows computed in each step. Raw events: `timeline_<mode>.json` beside each PNG.", ""]
    for t in timelines:
        rows = "—" if t["mean_decode_rows"] is None else f"{t['mean_decode_rows']:.1f}"
        line = (f"- **{t['mode']}**: {TIMELINE_CAPTIONS.get(t['mode'], 'our server')}. Here: "
                f"{_count(t['prefill_steps'], 'prefill step')}, {_count(t['decode_steps'], 'decode step')} "
                f"of {rows} rows on average, {t['span_s']:.1f} s from the first arrival to the last event.")
        parts.append(line)
        if t.get("png"):
            parts += ["", f"  ![{t['mode']} timeline]({link(t['png'], link_dir)})", ""]
    return parts + [""]


def report(args: argparse.Namespace, argv: Sequence[str] | None, traces: list[Trace],
           rows: list[dict[str, Any]], machine_start: str, elapsed: float, plots: list[str],
           sweep: Sequence[tuple[str, int, float]] = (), cpu_wait: float | None = None,
           timelines: Sequence[dict[str, Any]] = (), link_dir: str = BENCH_DIR,
           machine_end: str | None = None) -> str:
    """The study's markdown; image links are relative to link_dir (the folder of
    the file it is written to)."""
    cmd = "python -m bench.serving.batching_study" + ("" if not argv else " " + " ".join(argv))
    parts = [f"## Batching study, {datetime.date.today().isoformat()}", "", f"`{cmd}`", "",
             f"Machine at the start: {machine_start}. At the end: {machine_end or machine_line()}. "
             f"Whole study: {elapsed / 60:.1f} min"
             + ("" if cpu_wait is None else f", CPU wait {cpu_wait:.0%} of it") + ". "
             f"B = {args.batch_size} for every batched mode; greedy, EOS ignored; TTFT/ITL in ms; "
             "utilisation = useful / computed row-steps; CPU wait = share of the run in which some task "
             "waited for a core (/proc/pressure/cpu; this benchmark's own processes count too).", ""]
    for t in traces:
        parts += [f"### Trace `{t.name}`: {t.description}", "", markdown_table(rows, t.name), ""]
        parts += timeline_section([tl for tl in timelines if tl.get("trace", t.name) == t.name], t.name,
                                  link_dir)
    if sweep:
        parts += [f"Utilisation of full padded batches of B, {args.sweep_num_prompts} requests with "
                  f"exponential output lengths of mean {args.sweep_mean_output:g} (all sent at once), "
                  "against the chapter's 1/H_B:", "", "| B | measured | 1/H_B |", "|---|---|---|"]
        parts += [f"| {b} | {u:.3f} | {1 / harmonic(b):.3f} |" for _, b, u in sweep] + [""]
    if plots:
        root = os.path.dirname(BENCH_DIR)
        shown = [os.path.relpath(p, root) if p.startswith(root + os.sep) else p for p in plots]
        parts += ["Plots: " + ", ".join(f"`{p}`" for p in shown), ""]
    return "\n".join(parts)


def write_report(text_for: Callable[[str], str], md_path: str, record_as: str | None = None,
                 **record: Any) -> str:
    """Writes a report to `md_path` and, when `record_as` names the benchmark
    (bench.serving.sweep), records the run: its record, with `record`'s fields,
    and bench/RESULTS.md rendered again (run_record.record_run).
    `text_for(path)` renders it with links relative to that file's folder."""
    text = text_for(md_path)
    with open(md_path, "w") as f:
        f.write(text + "\n")
    if record_as is not None:
        record_run(text_for(RESULTS_MD), record_as, **record)
    return text
