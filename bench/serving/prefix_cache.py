"""What the prefix (radix) cache buys: the same workloads served with it on and off.

    python -m bench.serving.prefix_cache    # both workloads, cache on then off: some 8 min on 2 quiet cores (estimated)
    python -m bench.serving.prefix_cache --workloads shared-prefix --num-groups 4 --append-results
    # issue 13's targets: room for every request of the burst, cache-aware order
    python -m bench.serving.prefix_cache --server-args='--max-running-requests 128 --schedule-policy lpm' --append-results

Two workloads, each served twice by a fresh server of ours (launch.py): once
with the default flags (cache on) and once with --off-server-args (default
--disable-radix-cache):
- `shared-prefix` (SGLang's generated-shared-prefix): --num-groups random
  system prompts of --system-prompt-len tokens, each shared by
  --prompts-per-group prompts that add a random --question-len-token question;
  --output-len output tokens each; all sent at once (--request-rate inf);
- `multi-turn`: --num-conversations conversations of --num-turns turns; every
  turn resends the whole conversation (earlier questions and the server's
  answers) plus a random --turn-question-len-token question and asks for
  --turn-output-len tokens; a conversation's next turn goes once its previous
  answer has arrived; the conversations start at once.

Before each run: wait for a quiet CPU (bench/lib/cpu_pressure.py), start the
server, warm it up with an unrelated prompt, empty its cache (POST
/flush_cache). Each row: output throughput, TTFT p50/p99, the cache hit rate
(the server's cached prompt tokens over all its prompt tokens), the prefix
share (the prompt tokens that repeat the start of an earlier prompt: what a
cache of prompts alone could hit, when no two requests that share a prefix are
prefilled together), the load average at the start and the CPU wait.

Writes --out-dir/prefix_cache.json ({command, machine, workloads, rows,
ratios}) and prefix_cache.md; with --record the run is also recorded
(bench/results/latest/prefix_cache.json, from which bench/RESULTS.md is
rendered again). Flags that take server flags need the `=` form
when the value starts with a dash: --off-server-args='--schedule-policy fcfs'.

Output: bench/results/prefix_cache.json, prefix_cache.md; --record: its record
bench/results/latest/prefix_cache.json and bench/RESULTS.md (rendered again)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from bench.lib.backends import RequestConfig
from bench.serving.bench_serving import flush_cache, load_client_tokenizer, run_benchmark, run_conversations, warm_up
from bench.lib.cpu_pressure import CpuWait, add_quiet_cpu_args, wait_for_quiet
from bench.lib.datasets import (Conversation, DatasetRow, poisson_arrivals, sample_conversations, sample_rows)
from bench.lib.run_record import LoadAverage, loadavg
from bench.lib.server_launcher import LaunchedServer, unwind_on_sigterm
from bench.lib.study_report import fmt, machine_line, write_report

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
WORKLOADS = ("shared-prefix", "multi-turn")
CACHE_MODES = ("on", "off")
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 32, 8


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} prefix_cache] {msg}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    name: str
    description: str
    offsets: list[float]  # per request (shared-prefix) or per conversation (multi-turn)
    rows: list[DatasetRow] = field(default_factory=list)  # shared-prefix
    conversations: list[Conversation] = field(default_factory=list)  # multi-turn


# ---- the traces and what a cache could reuse in them ---------------------------------------------


def shared_prefix_share(rows: Sequence[DatasetRow]) -> float:
    """Share of the prompt tokens (client's count) that repeat an earlier-sent
    prompt's start: a group's system prompt, in every prompt but its first."""
    seen: set[int] = set()
    shared = 0
    for r in rows:
        if r.group in seen:
            shared += r.prefix_len
        seen.add(r.group)
    total = sum(r.prompt_len for r in rows)
    return shared / total if total else 0.0


def multi_turn_share(raw: dict[str, Any]) -> float | None:
    """Share of the prompt tokens (server's count, answered turns) that are the
    previous turn's whole prompt. A cache that also keeps the answers can hit
    more than this."""
    lens, convs, errors = raw["input_lens"], raw["conversation_ids"], raw["errors"]
    shared = total = 0
    for i, (n, conv, err) in enumerate(zip(lens, convs, errors)):
        if err:
            continue
        total += n
        if i > 0 and convs[i - 1] == conv and not errors[i - 1]:
            shared += lens[i - 1]
    return shared / total if total else None


def build_workloads(args: argparse.Namespace, tokenizer: Any) -> list[Workload]:
    out = []
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson arrivals at {args.request_rate:g}/s"
    if "shared-prefix" in args.workloads:
        rows = sample_rows("generated-shared-prefix", tokenizer, num=0, seed=args.seed, input_len=0, output_len=0,
                           gsp={"num_groups": args.num_groups, "prompts_per_group": args.prompts_per_group,
                                "system_prompt_len": args.system_prompt_len, "question_len": args.question_len,
                                "output_len": args.output_len})
        lens = [r.prompt_len for r in rows]
        out.append(Workload(
            "shared-prefix",
            f"{args.num_groups} groups x {args.prompts_per_group} prompts, each its group's "
            f"{args.system_prompt_len}-token system prompt + its own {args.question_len}-token question "
            f"(prompts {min(lens)}-{max(lens)} tokens by the client), {args.output_len} output tokens each, "
            f"shuffled, {rate}",
            poisson_arrivals(np.random.default_rng(args.seed), len(rows), args.request_rate), rows=rows))
    if "multi-turn" in args.workloads:
        convs = sample_conversations(tokenizer, num=args.num_conversations, turns=args.num_turns,
                                     question_len=args.turn_question_len, output_len=args.turn_output_len,
                                     seed=args.seed)
        out.append(Workload(
            "multi-turn",
            f"{args.num_conversations} conversations x {args.num_turns} turns, each turn the whole conversation "
            f"so far + a new question of {args.turn_question_len} tokens, answers of {args.turn_output_len}; "
            f"conversations start {rate}, a turn goes when the previous answer has arrived",
            poisson_arrivals(np.random.default_rng(args.seed), len(convs), args.request_rate),
            conversations=convs))
    return out


# ---- one run ----------------------------------------------------------------------------------------


def mode_flags(args: argparse.Namespace, cache: str) -> list[str]:
    return [*args.server_args, *(args.on_server_args if cache == "on" else args.off_server_args)]


def measure(w: Workload, cache: str, args: argparse.Namespace, model_dir: str, tokenizer: Any,
            warmup: DatasetRow, log_dir: str) -> dict[str, Any]:
    log = os.path.join(log_dir, f"{w.name}-{cache}.log")
    with LaunchedServer.ours(["--model-path", model_dir, *mode_flags(args, cache)], log) as srv:
        cfg = RequestConfig(backend="sglang", base_url=srv.url)
        res = asyncio.run(warm_up(cfg, warmup, tokenizer.decode))
        if not res.success:
            raise RuntimeError(f"warm-up request failed: {res.error}")
        flushed = flush_cache(cfg)
        if w.rows:
            raw = run_benchmark(cfg, w.rows, w.offsets, tokenizer, args.max_concurrency, warmup_requests=0,
                                disable_tqdm=True)
            share: float | None = shared_prefix_share(w.rows)
        else:
            raw = run_conversations(cfg, w.conversations, w.offsets, tokenizer, args.max_concurrency,
                                    warmup_requests=0, disable_tqdm=True)
            share = multi_turn_share(raw)
    return {
        "output_throughput": raw["output_throughput"],
        "ttft_p50": raw["median_ttft_ms"],
        "ttft_p99": raw["p99_ttft_ms"],
        "cache_hit_rate": raw["cache_hit_rate"],
        "prefix_share": share,
        "total_input_tokens": raw["total_input_tokens"],
        "total_cached_tokens": raw["total_cached_tokens"],
        "completed": raw["completed"],
        "failed": raw["failed"],
        "duration_s": raw["duration"],
        "flushed": flushed,
        "errors": sorted({e for e in raw["errors"] if e})[:3],
    }


def run_one(w: Workload, cache: str, args: argparse.Namespace, model_dir: str, tokenizer: Any,
            warmup: DatasetRow, log_dir: str) -> dict[str, Any]:
    """One workload in one cache mode: the least contended of 1 + --retries
    attempts; a failure (e.g. a server that refuses the off flags) is kept as
    a row with its status."""
    best: dict[str, Any] | None = None
    for attempt in range(1, args.retries + 2):
        if args.quiet_threshold < 1:
            level = wait_for_quiet(args.quiet_threshold, args.quiet_timeout)
            if level is not None and level >= args.quiet_threshold:
                say(f"CPU still busy (waiting share {level:.0%}); measuring anyway")
        row: dict[str, Any] = {"workload": w.name, "cache": cache, "server_flags": " ".join(mode_flags(args, cache)),
                               "load_average": [round(x, 2) for x in os.getloadavg()]}
        say(f"{w.name}, cache {cache} ..." + (f" (attempt {attempt})" if attempt > 1 else ""))
        t0 = time.perf_counter()
        with CpuWait() as wait:
            try:
                row.update(measure(w, cache, args, model_dir, tokenizer, warmup, log_dir))
                row["status"] = "ok" if not row["failed"] else f"{row['failed']} request(s) failed"
            except Exception as e:  # keep the other runs
                first = str(e).splitlines()[0][:200] if str(e) else ""
                row["status"] = f"failed: {type(e).__name__}: {first}"
        row.update(cpu_wait=wait.share, attempts=attempt)
        measured = "output_throughput" in row
        say(f"{w.name}, cache {cache}: {row['status']}, {time.perf_counter() - t0:.0f} s"
            + (f", {row['output_throughput']:.1f} tok/s, hit rate {row['cache_hit_rate']:.2f}" if measured else "")
            + (f", CPU wait {wait.share:.0%}" if wait.share is not None else ""))
        if best is None or (measured and ("output_throughput" not in best
                                          or (row["cpu_wait"] or 0) < (best["cpu_wait"] or 0))):
            best = row
        if not measured or wait.share is None or wait.share <= args.max_cpu_wait:
            break  # failures are not retried: they are not noise
    assert best is not None
    return best


# ---- report -----------------------------------------------------------------------------------------


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, cache on over cache off: TTFT (below 1: the cache helps) and
    output throughput (above 1: the cache helps); None where a side is missing."""
    def ratio(on: dict[str, Any] | None, off: dict[str, Any] | None, key: str) -> float | None:
        a, b = (on or {}).get(key), (off or {}).get(key)
        return a / b if a is not None and b else None

    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        on = next((r for r in rows if r["workload"] == name and r["cache"] == "on"), None)
        off = next((r for r in rows if r["workload"] == name and r["cache"] == "off"), None)
        out.append({"workload": name, "ttft_p50_ratio": ratio(on, off, "ttft_p50"),
                    "ttft_p99_ratio": ratio(on, off, "ttft_p99"),
                    "throughput_ratio": ratio(on, off, "output_throughput")})
    return out


def markdown_tables(rows: Sequence[dict[str, Any]], rs: Sequence[dict[str, Any]]) -> str:
    out = ["| workload | cache | output tok/s | TTFT p50 ms | TTFT p99 ms | cache hit rate | prefix share "
           "| prompt tokens | cached tokens | load avg (1 min) | CPU wait | status |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wait = "—" if r.get("cpu_wait") is None else f"{r['cpu_wait']:.0%}"
        out.append(f"| {r['workload']} | {r['cache']} | {fmt(r.get('output_throughput'))} "
                   f"| {fmt(r.get('ttft_p50'), 0)} | {fmt(r.get('ttft_p99'), 0)} | {fmt(r.get('cache_hit_rate'), 3)} "
                   f"| {fmt(r.get('prefix_share'), 3)} | {fmt(r.get('total_input_tokens'))} "
                   f"| {fmt(r.get('total_cached_tokens'))} | {fmt(r['load_average'][0], 2)} | {wait} "
                   f"| {r['status']} |")
    out += ["", "| workload | TTFT p50, on / off | TTFT p99, on / off | output throughput, on / off |",
            "|---|---|---|---|"]
    out += [f"| {x['workload']} | {fmt(x['ttft_p50_ratio'], 2)} | {fmt(x['ttft_p99_ratio'], 2)} "
            f"| {fmt(x['throughput_ratio'], 2)} |" for x in rs]
    return "\n".join(out)


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the hit rates say about the build that was measured."""
    lines = []
    ok = [r for r in rows if r.get("cache_hit_rate") is not None]
    if any(r["cache"] == "on" for r in ok) and all(r["cache_hit_rate"] == 0 for r in ok if r["cache"] == "on"):
        lines.append("With the cache on, the server reported no cached prompt token: this build has no prefix "
                     "cache (or it never hit), so the on/off ratios show only run-to-run noise.")
    if any(r["cache"] == "off" and r["cache_hit_rate"] > 0 for r in ok):
        lines.append("With the cache off, the server still reported cached prompt tokens: the off flags do not "
                     "turn its cache off.")
    return lines


def report(args: argparse.Namespace, argv: Sequence[str], workloads: Sequence[Workload],
           rows: Sequence[dict[str, Any]], rs: Sequence[dict[str, Any]], machine_start: str, machine_end: str,
           elapsed: float, cpu_wait: float | None) -> str:
    cmd = "python -m bench.serving.prefix_cache" + ("" if not argv else " " + " ".join(argv))
    parts = [f"## Prefix cache on and off, {datetime.date.today().isoformat()}", "", f"`{cmd}`", "",
             f"Machine at the start: {machine_start}. At the end: {machine_end}. Whole run: {elapsed / 60:.1f} min"
             + ("" if cpu_wait is None else f", CPU wait {cpu_wait:.0%} of it") + ".", ""]
    parts += [f"- `{w.name}`: {w.description}." for w in workloads]
    parts += ["", f"Server flags: cache on `{' '.join(mode_flags(args, 'on')) or '(defaults)'}`, cache off "
              f"`{' '.join(mode_flags(args, 'off'))}`. Each run: a fresh server, an unrelated warm-up request, "
              "the cache emptied (POST /flush_cache), then the workload; greedy, EOS ignored. Cache hit rate: the "
              "server's `cached_tokens` over its prompt tokens. Prefix share: the prompt tokens that repeat the "
              "start of an earlier prompt (a group's system prompt after its first prompt; the previous turn's "
              "prompt), what a cache of prompts could hit if no two requests sharing a prefix were prefilled "
              "together (a cache that keeps answers hits more on multi-turn). TTFT in ms; load average at the "
              "start of each run; CPU wait as in the batching study.", "",
              markdown_tables(rows, rs), ""]
    extra = notes(rows)
    if extra:
        parts += [" ".join(extra), ""]
    return "\n".join(parts)


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder (default: the bundled model, converted)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: system prompts")
    p.add_argument("--prompts-per-group", type=int, default=16,
                   help="shared-prefix: prompts per system prompt (SGLang's default)")
    p.add_argument("--system-prompt-len", type=int, default=1024, help="shared-prefix: tokens of a system prompt")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens of a question")
    p.add_argument("--output-len", type=int, default=64, help="shared-prefix: output tokens per request")
    p.add_argument("--num-conversations", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--turn-question-len", type=int, default=128, help="multi-turn: tokens of a question")
    p.add_argument("--turn-output-len", type=int, default=64, help="multi-turn: tokens of an answer")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (shared-prefix) or conversation starts (multi-turn) per second; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--server-args", default="", help="more flags for every server, e.g. '--max-running-requests 16'")
    p.add_argument("--on-server-args", default="", help="more flags for the cache-on servers")
    p.add_argument("--off-server-args", default="--disable-radix-cache", help="the flags that turn the cache off")
    add_quiet_cpu_args(p, "run", retries=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--record", "--append-results", dest="record", action="store_true",
                   help="record the run: bench/results/latest/prefix_cache.json, and bench/RESULTS.md rendered "
                        "again (--append-results: its name when it appended to bench/RESULTS.md)")
    args = p.parse_args(argv)
    args.workloads = list(dict.fromkeys(args.workloads))
    for name in ("server_args", "on_server_args", "off_server_args"):
        setattr(args, name, getattr(args, name).split())
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from bench.serving.batching_study import resolve_model_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine_start, load_start = time.perf_counter(), machine_line(), loadavg()
    model_dir = resolve_model_dir(args.model_path)
    tokenizer = load_client_tokenizer(model_dir)
    workloads = build_workloads(args, tokenizer)
    warmup = sample_rows("random-ids", tokenizer, num=1, seed=args.seed + 1, input_len=WARMUP_PROMPT_LEN,
                         output_len=WARMUP_OUTPUT_LEN, range_ratio=1.0)[0]
    log_dir = tempfile.mkdtemp(prefix="prefix-cache-")
    say(f"model {model_dir}; server logs in {log_dir}")
    with CpuWait() as wait:
        rows = [run_one(w, cache, args, model_dir, tokenizer, warmup, log_dir)
                for w in workloads for cache in CACHE_MODES]
    rs = ratios(rows)
    elapsed, machine_end = time.perf_counter() - started, machine_line()
    result = {"command": "python -m bench.serving.prefix_cache " + " ".join(argv), "machine_start": machine_start,
              "machine_end": machine_end, "elapsed_s": elapsed, "cpu_wait": wait.share,
              "workloads": {w.name: w.description for w in workloads}, "rows": rows, "ratios": rs}
    with open(os.path.join(args.out_dir, "prefix_cache.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = write_report(lambda _: report(args, argv, workloads, rows, rs, machine_start, machine_end, elapsed,
                                         wait.share),
                        os.path.join(args.out_dir, "prefix_cache.md"),
                        "bench.serving.prefix_cache" if args.record else None,
                        data={"rows": rows, "ratios": rs}, load_average=LoadAverage(load_start, loadavg()))
    print(text)
    return result


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
