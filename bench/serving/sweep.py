"""The chapter's "what to watch" sweep: output throughput against
--max-running-requests on one trace, with the retraction count of every point.

    python -m bench.serving.sweep                # N = 1 4 16 64 256: about 7 minutes on 2 quiet cores (estimated)
    python -m bench.serving.sweep --max-running-requests 1 8 64 --num-prompts 64 --random-output-len 16

The chapter: the curve should climb steeply, then flatten; if it falls at the
top, look for retractions: more rows were admitted than the KV pool can carry,
and their KV is being freed and recomputed. For each N: start our server with
--max-running-requests N and --max-total-tokens P, warm it up, send the trace,
read the retraction counter and the row-step counters from GET /get_server_info
(before and after), the decode steps' batch sizes from GET /timeline, count the
`KV cache pool is full. Retract requests.` log lines, and stop the server.

Defaults, sized for SmolLM2-135M in float32 on 2 cores (decode about 30 ms a
step at batch 1, 160 ms at batch 64): 256 requests of 16 prompt tokens (token
ids, exact) and up to 32 output tokens, all sent at once. Estimated, not timed
on a quiet machine: N = 1 about 4 minutes (256 x 31 decode steps), the other
points about 2.5 minutes together, plus some 10 s per server start. The pool,
P = 3072 tokens, holds N = 64's worth: a request holds at most 16 + 31 slots,
so 65 whole requests fit and N <= 64 never runs short. N = 256 must retract:
the scheduler admits on its new_token_ratio estimate of the output still to
come (0.7 of it at first, so 16 + 23 slots a request: 78 rows), the rows then
outgrow the pool, and the retracted ones are recomputed later. N = 256 can run
no more rows than N = 64 for long, so what it loses to them is the fall.

EOS is honoured by default, as a real client's requests are: with --ignore-eos
the scheduler reserves every row's whole output at admission (the output
length is then certain), so it never retracts and the top of the sweep cannot
fall for that reason. With EOS on, a row may stop early; the total output
tokens of each point are reported.

Writes under --out-dir: sweep.json (one object per N), sweep.md and, with
matplotlib, sweep.png; with --record the run is also recorded
(bench/results/latest/sweep.json, from which bench/RESULTS.md is rendered again).

Output: bench/results/sweep.json, sweep.md, sweep.png; --record: its record bench/results/latest/sweep.json
and bench/RESULTS.md (rendered again)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from bench.lib.backends import RequestConfig
from bench.serving.bench_serving import load_client_tokenizer, run_benchmark, scheduler_counters, utilisation_between, warm_up
from bench.lib.cpu_pressure import CpuWait, add_quiet_cpu_args, wait_for_quiet
from bench.lib.datasets import DatasetRow, poisson_arrivals, sample_rows
from bench.lib.run_record import LoadAverage, loadavg
from bench.lib.server_launcher import LaunchedServer, unwind_on_sigterm
from bench.plots.study_plots import have_matplotlib, pyplot
from bench.lib.study_report import fmt, link, machine_line, write_report
from bench.plots.timeline_plot import fetch_timeline

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
DEFAULT_VALUES = (1, 4, 16, 64, 256)
RETRACT_LINE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} sweep] {msg}", file=sys.stderr, flush=True)


# ---- one point ---------------------------------------------------------------------------------


def decode_batches(base_url: str, since: float, seq_before: int) -> tuple[list[int], bool]:
    """Rows of every decode step recorded since `since`, and whether the
    timeline held all of them (it keeps and returns only the newest events)."""
    reply = fetch_timeline(base_url, since)
    events = reply["events"]
    rows = [e["batch_size"] for e in events if e["type"] == "step" and e["kind"] == "decode"]
    return rows, reply["seq"] - seq_before == len(events)


def logged_retractions(log_path: str) -> int:
    """Requests retracted according to the server's log lines (what the chapter says to grep)."""
    try:
        with open(log_path, errors="replace") as f:
            return sum(int(m.group(1)) for m in RETRACT_LINE.finditer(f.read()))
    except OSError:
        return 0


def measure_point(n: int, args: argparse.Namespace, model_dir: str, rows: list[DatasetRow],
                  offsets: list[float], tokenizer: Any, log_dir: str) -> dict[str, Any]:
    log = os.path.join(log_dir, f"sweep-{n}.log")
    flags = ["--model-path", model_dir, "--max-running-requests", str(n),
             "--max-total-tokens", str(args.max_total_tokens), *args.server_args]
    with LaunchedServer.ours(flags, log) as srv:
        cfg = RequestConfig(backend="sglang", base_url=srv.url, ignore_eos=args.ignore_eos)
        w = asyncio.run(warm_up(cfg, rows[0], tokenizer.decode))
        if not w.success:
            raise RuntimeError(f"warm-up request failed: {w.error}")
        before = scheduler_counters(srv.url)
        since = time.time()
        seq_before = fetch_timeline(srv.url, since)["seq"]
        raw = run_benchmark(cfg, rows, offsets, tokenizer, warmup_requests=0, disable_tqdm=True)
        after = scheduler_counters(srv.url)
        batches, complete = decode_batches(srv.url, since, seq_before)
    retractions = (after["total_retractions"] - before["total_retractions"]) if before and after else None
    return {
        "max_running_requests": n,
        "output_throughput": raw["output_throughput"],
        "ratio_to_best": None,
        "ttft_p50": raw["median_ttft_ms"],
        "ttft_p99": raw["p99_ttft_ms"],
        "itl_p50": raw["median_itl_ms"],
        "itl_p99": raw["p99_itl_ms"],
        "retractions": retractions,  # the scheduler's counter over the trace
        "retractions_logged": logged_retractions(log),  # the same from its log lines
        "mean_running_batch": float(np.mean(batches)) if batches else None,  # rows per decode step
        "max_running_batch": max(batches, default=None),
        "decode_steps": len(batches),
        "decode_steps_complete": complete,
        "batch_utilisation": utilisation_between(before, after),
        "completed": raw["completed"],
        "failed": raw["failed"],
        "total_output_tokens": raw["total_output_tokens"],
        "duration_s": raw["duration"],
        "errors": sorted({e for e in raw["errors"] if e})[:3],
    }


def run_point(n: int, args: argparse.Namespace, model_dir: str, rows: list[DatasetRow], offsets: list[float],
              tokenizer: Any, log_dir: str) -> dict[str, Any]:
    """One N, the least contended of 1 + --retries attempts; a failure is kept
    with its status rather than lost."""
    best: dict[str, Any] | None = None
    for attempt in range(1, args.retries + 2):
        if args.quiet_threshold < 1:
            level = wait_for_quiet(args.quiet_threshold, args.quiet_timeout)
            if level is not None and level >= args.quiet_threshold:
                say(f"CPU still busy (waiting share {level:.0%}); measuring anyway")
        say(f"N = {n} ..." + (f" (attempt {attempt})" if attempt > 1 else ""))
        t0 = time.perf_counter()
        with CpuWait() as wait:
            try:
                point = measure_point(n, args, model_dir, rows, offsets, tokenizer, log_dir)
                point["status"] = "ok" if not point["failed"] else f"{point['failed']} request(s) failed"
            except Exception as e:  # keep the other points
                point = {"max_running_requests": n, "status": f"failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}"}
        point.update(cpu_wait=wait.share, attempts=attempt)
        say(f"N = {n}: {point['status']}, {time.perf_counter() - t0:.0f} s"
            + (f", {point['output_throughput']:.1f} tok/s, {point['retractions']} retractions"
               if "output_throughput" in point else "")
            + (f", CPU wait {wait.share:.0%}" if wait.share is not None else ""))
        measured = "output_throughput" in point
        if best is None or (measured and ("output_throughput" not in best
                                          or (point["cpu_wait"] or 0) < (best["cpu_wait"] or 0))):
            best = point
        if not measured or wait.share is None or wait.share <= args.max_cpu_wait:
            break  # failures are not retried: they are not noise
    assert best is not None
    return best


def add_ratios(points: list[dict[str, Any]]) -> None:
    best = max((p.get("output_throughput") or 0.0 for p in points), default=0.0)
    for p in points:
        if p.get("output_throughput") is not None and best > 0:
            p["ratio_to_best"] = p["output_throughput"] / best


# ---- report --------------------------------------------------------------------------------------


def whole_requests(rows: Sequence[DatasetRow], max_total_tokens: int) -> int:
    """Requests of the trace's largest size that the KV pool holds at once: a
    request's last token is sampled, never stored, so it holds prompt + output - 1."""
    return max_total_tokens // max(max(r.prompt_len + r.output_len - 1 for r in rows), 1)


def markdown_table(points: Sequence[dict[str, Any]]) -> str:
    out = ["| max running requests | output tok/s | ratio to best | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
           "| retractions | mean running batch | output tokens | CPU wait | status |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        wait = "—" if p.get("cpu_wait") is None else f"{p['cpu_wait']:.0%}"
        out.append(f"| {p['max_running_requests']} | {fmt(p.get('output_throughput'))} "
                   f"| {fmt(p.get('ratio_to_best'), 2)} | {fmt(p.get('ttft_p50'), 0)} "
                   f"| {fmt(p.get('ttft_p99'), 0)} | {fmt(p.get('itl_p50'), 0)} | {fmt(p.get('retractions'))} "
                   f"| {fmt(p.get('mean_running_batch'))} | {fmt(p.get('total_output_tokens'))} "
                   f"| {wait} | {p['status']} |")
    return "\n".join(out)


def whole(fits: int) -> str:
    return f"about {fits} whole request" + ("" if fits == 1 else "s")


def verdict(points: Sequence[dict[str, Any]], fits: int) -> str:
    """What the top of the sweep did, from the numbers."""
    ok = [p for p in points if p.get("output_throughput")]
    if len(ok) < 2:
        return ""
    best = max(ok, key=lambda p: p["output_throughput"])
    top = max(ok, key=lambda p: p["max_running_requests"])
    text = f"Throughput peaks at N = {best['max_running_requests']} ({best['output_throughput']:.1f} tok/s)."
    if top is best:
        return text + f" The top of the sweep (N = {top['max_running_requests']}) does not fall" + (
            f", with {top['retractions']} retraction(s)." if top.get("retractions") else ".")
    text += (f" At the top, N = {top['max_running_requests']}, it is {top['ratio_to_best']:.2f} of that, with "
             f"{fmt(top.get('retractions'))} retractions and {fmt(top.get('mean_running_batch'))} rows per "
             "decode step")
    if top.get("retractions"):
        return text + (f": the pool holds {whole(fits)}, so the scheduler admitted rows it "
                       "later had to retract and recompute.")
    return text + ": no retraction, so not the KV pool (see the CPU wait and ITL columns)."


def report(args: argparse.Namespace, argv: Sequence[str], points: list[dict[str, Any]], trace: str, fits: int,
           machine_start: str, machine_end: str, elapsed: float, cpu_wait: float | None, plot: str | None,
           link_dir: str) -> str:
    """The sweep's markdown; the plot's link is relative to link_dir."""
    cmd = "python -m bench.serving.sweep" + ("" if not argv else " " + " ".join(argv))
    parts = [f"## Throughput against --max-running-requests, {datetime.date.today().isoformat()}", "",
             f"`{cmd}`", "",
             f"Machine at the start: {machine_start}. At the end: {machine_end}. Whole sweep: "
             f"{elapsed / 60:.1f} min" + ("" if cpu_wait is None else f", CPU wait {cpu_wait:.0%} of it") + ".",
             "",
             f"Trace: {trace}. KV pool {args.max_total_tokens} tokens (--max-total-tokens): {whole(fits)} "
             "at once. EOS " + ("ignored (every row is reserved its whole output: no retraction)"
                                         if args.ignore_eos else "honoured (the scheduler admits on its "
                                         "new_token_ratio estimate and retracts when rows outgrow the pool)")
             + ". Retractions: the scheduler's counter over the trace (its log lines agree: "
             + ("yes" if all(p.get("retractions") == p.get("retractions_logged") for p in points
                             if "retractions" in p) else "NO, see sweep.json") + "); mean running batch: rows "
             "per decode step (GET /timeline); TTFT/ITL in ms; CPU wait as in the batching study.", "",
             markdown_table(points), ""]
    line = verdict(points, fits)
    if line:
        parts += [line, ""]
    if plot:
        parts += [f"![throughput against --max-running-requests]({link(plot, link_dir)})", ""]
    return "\n".join(parts)


def draw(points: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Throughput against N on a log2 axis; retractions on a second axis."""
    plt = pyplot()
    ok = [p for p in points if p.get("output_throughput") is not None]
    ns = [p["max_running_requests"] for p in ok]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [p["output_throughput"] for p in ok], "o-", color="C0", label="output throughput")
    for p in ok:
        if p.get("mean_running_batch") is not None:
            b = p["mean_running_batch"]
            ax.annotate(f"{b:.1f} rows" if b < 10 else f"{b:.0f} rows",
                        (p["max_running_requests"], p["output_throughput"]),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7, color="C0")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("--max-running-requests (N)")
    ax.set_ylabel("output throughput (tok/s)", color="C0")
    ax.set_ylim(0, max([p["output_throughput"] for p in ok] + [1.0]) * 1.15)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(ns, [p.get("retractions") or 0 for p in ok], "s--", color="C3", label="retractions")
    right.set_ylabel("retractions", color="C3")
    right.set_ylim(0, max([p.get("retractions") or 0 for p in ok] + [1]) * 1.15)
    for p in ok:
        if p.get("retractions"):
            right.annotate(str(p["retractions"]), (p["max_running_requests"], p["retractions"]),
                           textcoords="offset points", xytext=(-8, -3), ha="right", fontsize=7, color="C3")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-running-requests", type=int, nargs="+", default=list(DEFAULT_VALUES),
                   help="the values of N to sweep")
    p.add_argument("--model-path", default=None, help="HF folder (default: the bundled model, converted)")
    p.add_argument("--max-total-tokens", type=int, default=3072,
                   help="KV pool of every point, in tokens (the default holds 65 whole requests of the "
                        "default trace: N = 256 retracts)")
    p.add_argument("--dataset-name", choices=("random-ids", "random", "exponential"), default="random-ids",
                   help="random-ids: exact prompt lengths; random: text; exponential: output lengths "
                        "exponential with mean --random-output-len")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--random-input-len", type=int, default=16)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths uniform in [len * ratio, len] (1.0: fixed)")
    p.add_argument("--exponential-max-len", type=int, default=None, help="exponential: clip output lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf: all at once")
    p.add_argument("--ignore-eos", action="store_true",
                   help="exact output lengths; the server then reserves them whole and never retracts")
    p.add_argument("--server-args", default="", help="more flags for every server, e.g. '--dtype bfloat16'")
    add_quiet_cpu_args(p, "point", retries=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--record", "--append-results", dest="record", action="store_true",
                   help="record the run: bench/results/latest/sweep.json, and bench/RESULTS.md rendered again "
                        "(--append-results: its name when it appended to bench/RESULTS.md)")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.max_running_requests):
        p.error("--max-running-requests values must be >= 1")
    args.server_args = args.server_args.split()
    return args


def build_trace(args: argparse.Namespace, tokenizer: Any) -> tuple[list[DatasetRow], list[float], str]:
    rows = sample_rows(args.dataset_name, tokenizer, num=args.num_prompts, seed=args.seed,
                       input_len=args.random_input_len, output_len=args.random_output_len,
                       range_ratio=args.random_range_ratio, exponential_max_len=args.exponential_max_len)
    offsets = poisson_arrivals(np.random.default_rng(args.seed), len(rows), args.request_rate)
    ins, outs = [r.prompt_len for r in rows], [r.output_len for r in rows]
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson arrivals at {args.request_rate:g} req/s"
    desc = (f"`{args.dataset_name}`, {len(rows)} requests, prompts {min(ins)}-{max(ins)} tokens, "
            f"max_new_tokens {min(outs)}-{max(outs)} (sum {sum(outs)}), {rate}, greedy")
    return rows, offsets, desc


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    from bench.serving.batching_study import resolve_model_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine_start, load_start = time.perf_counter(), machine_line(), loadavg()
    model_dir = resolve_model_dir(args.model_path)
    tokenizer = load_client_tokenizer(model_dir)
    rows, offsets, trace = build_trace(args, tokenizer)
    log_dir = tempfile.mkdtemp(prefix="sweep-")
    say(f"model {model_dir}; trace {trace}; server logs in {log_dir}")
    with CpuWait() as wait:
        points = [run_point(n, args, model_dir, rows, offsets, tokenizer, log_dir)
                  for n in args.max_running_requests]
    add_ratios(points)
    elapsed, machine_end = time.perf_counter() - started, machine_line()

    with open(os.path.join(args.out_dir, "sweep.json"), "w") as f:
        json.dump(points, f, indent=1)
    plot = None
    if not args.no_plots:
        if have_matplotlib():
            plot = os.path.join(args.out_dir, "sweep.png")
            draw(points, plot, f"{os.path.basename(model_dir.rstrip('/'))}, {len(rows)} requests, "
                               f"KV pool {args.max_total_tokens} tokens")
        else:
            say("matplotlib is not installed: no plot (pip install matplotlib)")

    def text_for(md_path: str) -> str:  # the plot's link relative to the file it is in
        return report(args, argv, points, trace, whole_requests(rows, args.max_total_tokens), machine_start,
                      machine_end, elapsed, wait.share, plot, os.path.dirname(os.path.abspath(md_path)))

    sweep_md = os.path.join(args.out_dir, "sweep.md")
    text = write_report(text_for, sweep_md, "bench.serving.sweep" if args.record else None, data=points,
                        load_average=LoadAverage(load_start, loadavg()))
    print(text)
    return points


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
