"""What n-gram speculative decoding (--speculative-algorithm NGRAM) buys: an editing workload
and a random trace, served with it and without, the greedy outputs compared.

    python -m bench.serving.spec_decode                  # 3 cases x 2 servers: ~5 min on 2 quiet cores
    python -m bench.serving.spec_decode --quick --no-write   # a smoke run: 2-3 min

Two servers of ours, never at once: `base` (launch.py, the default model,
default flags plus --max-running-requests 32) and `spec` (the same plus
--speculative-algorithm NGRAM --speculative-num-draft-tokens 8). Three cases:
- `single`: the editing workload (bench/lib/spec_workloads.py: return a
  source file of this repo with one name changed, quote and summarise a
  paragraph of the docs, return a JSON object of ServerArgs' defaults with
  one key renamed; chat completions, greedy, max_tokens 256), one request
  after another (--single-requests, 8);
- `concurrent-8`: the same workload, --concurrent-requests (16), 8 in flight;
- `random-32`: random token ids, 128 +- 64 in, 128 out, EOS
  ignored, OpenAI completions, 32 in flight (--random-prompts, 64).
Cases take turns between the servers: for each case a fresh `base` server
serves it, then a fresh `spec` server (one round; the order is the same in
every case), so a change in the machine's load hits both alike and the
spec server's table of recent outputs holds only the case's own. Each
server gets one warm-up request that is not in the case. Requests go
through bench_serving's client (streamed).

Per case: output tok/s of each server and their ratio (spec / base) beside
the issue's target (not asserted); median ITL (the gap between streamed
chunks, as bench_serving counts the OpenAI routes: a chunk is a token, and
under speculation a chunk carries a verify step's accepted tokens) and
median TPOT (per token: (latency - TTFT) / (output tokens - 1)); from the
spec server's GET /get_server_info, read before and after the case: verify
steps, draft tokens, accepted tokens, the accept rate (accepted / drafted)
and the server's average accept length (tokens a speculating row kept per
verify, its last 256 rows); and how many answers are identical between the
two servers (every request is greedy: they should all be). A mismatch is
printed with the request and where the texts part. Each server's sources are
hashed at its start (the checkout may be edited while the benchmark runs): a
run whose servers ran different code says so under its table.

--llama-server PATH (llama.cpp's llama-server binary): the single-stream case
also on llama.cpp serving the same GGUF (`-t 2 -c 8192 -np 1`), without and
with its own n-gram speculation (`--spec-type ngram-simple`, its defaults),
each fresh, through the same client; a second table gives their tok/s, the
ratio of its speculation to its own base, and how many of its answers its
speculation left identical.

Output: its record bench/results/latest/spec_decode.json and bench/RESULTS.md (rendered again);
--no-write: stdout only
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.lib import spec_workloads
from bench.lib.backends import RequestConfig
from bench.lib.datasets import DatasetRow, rows_from_lengths
from bench.lib.run_record import LoadAverage, record_run
from bench.lib.server_launcher import ROOT, LaunchedServer, free_port, unwind_on_sigterm
from bench.serving import bench_serving

BASE_FLAGS = ["--max-running-requests", "32"]
SERVERS = ("base", "spec")
# the targets: spec output tok/s over base's, per case (printed, not asserted)
TARGETS = {"single": 2.0, "concurrent-8": 1.4, "random-32": 0.97}
TITLES = {"single": "single stream, editing", "concurrent-8": "8 concurrent, editing",
          "random-32": "32 concurrent, random"}
SPEC_COUNTERS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")
WARMUP_PROMPT = "Say hello in one short sentence."
SERVER_SOURCES = ("launch.py", "common", "scheduler_proc", "model_proc", "tokenizer_proc")
SOURCE_SUFFIXES = (".py", ".cpp", ".c", ".h")


@dataclass
class Case:
    name: str          # a key of TARGETS
    backend: str       # bench_serving's: openai-chat (the editing workload) or openai (random ids)
    concurrency: int
    rows: list[DatasetRow]
    warm_row: DatasetRow
    ignore_eos: bool
    sources: list[str] = field(default_factory=list)  # each row's request: kind and source (editing)


@dataclass
class ServerRun:
    output_throughput: float  # tok/s
    median_itl_ms: float
    median_tpot_ms: float
    output_tokens: int
    failed: int
    first_error: str
    duration_s: float
    source_digest: str  # the server's sources at its start (server_source_digest)
    texts: list[str]
    spec: dict[str, Any] | None  # spec server: its counters' deltas over the case, and its figures after it


def server_source_digest() -> str:
    """A digest of the server's sources as they are now. A server runs the code
    of its start, and a checkout may be edited while the benchmark runs: a
    pair whose digests differ compares two versions of the server."""
    files = []
    for top in SERVER_SOURCES:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            files.append(path)
        for folder, _, names in os.walk(path):
            files += [os.path.join(folder, n) for n in names if n.endswith(SOURCE_SUFFIXES)]
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(os.path.relpath(f, ROOT).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The spec counters' change over a case, the accept rate of that change,
    and the figures the server keeps over a window (read after the case)."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["accept_rate"] = d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] else 0.0
    d["avg_spec_accept_length"] = after.get("avg_spec_accept_length", 0.0)
    d["spec_step_cost_ms"] = after.get("spec_step_cost_ms")
    return d


def scheduler_state(url: str) -> dict[str, Any]:
    info = bench_serving.get_json(url + "/get_server_info") or {}
    return info.get("scheduler") or {}


def serve_case(flags: list[str], log: str, case: Case, tokenizer: Any, speculative: bool) -> ServerRun:
    """A fresh server, one warm-up request, the case, the server stopped."""
    digest = server_source_digest()
    with LaunchedServer.ours(flags, log) as srv:
        cfg = RequestConfig(backend=case.backend, base_url=srv.url, model=bench_serving.default_model_name(srv.url),
                            ignore_eos=case.ignore_eos)
        bench_serving.prepare(cfg, case.warm_row, tokenizer, warmup_requests=1, flush=False)
        before = scheduler_state(srv.url)
        if speculative and before.get("speculative_algorithm") != "NGRAM":
            raise RuntimeError(f"the spec server does not say it speculates: {before.get('speculative_algorithm')!r}")
        res = bench_serving.run_benchmark(cfg, case.rows, [0.0] * len(case.rows), tokenizer, case.concurrency,
                                          warmup_requests=0, disable_tqdm=True)
        after = scheduler_state(srv.url)
        if res["failed"]:
            print(f"server log tail ({log}):\n{srv.log_tail()}", file=sys.stderr)
    errors = [e for e in res["errors"] if e]
    return ServerRun(res["output_throughput"], res["median_itl_ms"], res["median_tpot_ms"],
                     res["total_output_tokens"], res["failed"], errors[0] if errors else "", res["duration"],
                     digest, res["generated_texts"], spec_delta(before, after) if speculative and after else None)


LLAMA_SERVERS = {"llama.cpp": [], "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"]}


def serve_case_llama(binary: str, extra: list[str], gguf: str, log: str, case: Case, tokenizer: Any) -> ServerRun:
    """The case on a fresh llama-server (its n-gram speculation per `extra`)."""
    port = free_port()
    cmd = [binary, "-m", gguf, "--port", str(port), "-t", str(os.cpu_count() or 2), "-c", "8192", "-np", "1",
           *extra]
    with LaunchedServer(cmd, port, log) as srv:
        cfg = RequestConfig(backend=case.backend, base_url=srv.url, model="default", ignore_eos=case.ignore_eos)
        bench_serving.prepare(cfg, case.warm_row, tokenizer, warmup_requests=1, flush=False)
        res = bench_serving.run_benchmark(cfg, case.rows, [0.0] * len(case.rows), tokenizer, case.concurrency,
                                          warmup_requests=0, disable_tqdm=True)
    errors = [e for e in res["errors"] if e]
    return ServerRun(res["output_throughput"], res["median_itl_ms"], res["median_tpot_ms"],
                     res["total_output_tokens"], res["failed"], errors[0] if errors else "", res["duration"], "",
                     res["generated_texts"], None)


def llama_table(llama: dict[str, ServerRun], ours: dict[str, ServerRun]) -> str:
    """llama.cpp without and with its speculation, beside ours, on the single-stream case."""
    lines = ["| server | tok/s | TPOT ms | speculation / its base | answers its speculation left identical |",
             "|---|---|---|---|---|"]
    for name, run, base in [("batchserve", ours["base"], None),
                            ("batchserve --speculative-algorithm NGRAM", ours["spec"], ours["base"]),
                            ("llama.cpp", llama["llama.cpp"], None),
                            ("llama.cpp --spec-type ngram-simple", llama["llama.cpp ngram-simple"], llama["llama.cpp"])]:
        ratio = same = "-"
        if base is not None:
            ratio = f"{run.output_throughput / base.output_throughput:.2f}x"
            same = f"{sum(a == b for a, b in zip(run.texts, base.texts))}/{len(run.texts)}"
        lines.append(f"| {name} | {run.output_throughput:.1f} | {run.median_tpot_ms:.1f} | {ratio} | {same} |")
    return "\n".join(lines)


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatches(case: Case, base: ServerRun, spec: ServerRun) -> list[dict[str, Any]]:
    """The requests whose answers differ (both answered), with where they part."""
    out = []
    for i, (a, b) in enumerate(zip(base.texts, spec.texts)):
        if a != b and a and b:
            at = first_difference(a, b)
            out.append({"case": case.name, "request": i, "source": case.sources[i] if case.sources else "random ids",
                        "at_char": at, "base_len": len(a), "spec_len": len(b),
                        "base": a[max(0, at - 40):at + 40], "spec": b[max(0, at - 40):at + 40]})
    return out


def editing_rows(reqs: list[spec_workloads.ChatRequest], tokenizer: Any) -> list[DatasetRow]:
    # one user message each: bench_serving's openai-chat backend sends the row's prompt as it
    return [DatasetRow(r.prompt, len(tokenizer.encode(r.prompt)), r.max_tokens) for r in reqs]


def build_cases(args: argparse.Namespace, tokenizer: Any) -> list[Case]:
    warm_chat = DatasetRow(WARMUP_PROMPT, len(tokenizer.encode(WARMUP_PROMPT)), 16)
    edits = spec_workloads.editing_workload(max(args.single_requests, args.concurrent_requests), args.seed,
                                            args.max_tokens)
    rng = np.random.default_rng(args.seed)
    # 128 +- 64: uniform in [64, 192] (SGLang's --random-range-ratio would give [len * ratio, len])
    mean = args.random_input_len
    ins = [int(n) for n in rng.integers(mean - mean // 2, mean + mean // 2 + 1, size=args.random_prompts + 1)]
    random_rows = rows_from_lengths(rng, tokenizer, ins, [args.random_output_len] * len(ins), as_ids=True)
    cases = [
        Case("single", "openai-chat", 1, editing_rows(edits[:args.single_requests], tokenizer), warm_chat, False,
             [f"{r.kind} {r.source}" for r in edits[:args.single_requests]]),
        Case("concurrent-8", "openai-chat", 8, editing_rows(edits[:args.concurrent_requests], tokenizer), warm_chat,
             False, [f"{r.kind} {r.source}" for r in edits[:args.concurrent_requests]]),
        Case("random-32", "openai", 32, random_rows[1:], random_rows[0], True),
    ]
    return [c for c in cases if c.name in args.cases]


def report(command: str, rows: list[list[str]], found: list[dict[str, Any]], load: tuple[list[float], list[float]],
           args: argparse.Namespace, spec_flags: list[str], step_costs: dict[str, dict[str, list[float]]],
           digests: dict[str, dict[str, str]]) -> str:
    header = ["case", "requests", "base tok/s", "spec tok/s", "spec/base", "target", "base ITL ms", "spec ITL ms",
              "base TPOT ms", "spec TPOT ms", "verify steps", "accept rate", "avg accept length",
              "identical outputs"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    start, end = (" / ".join(f"{x:.2f}" for x in la) for la in load)
    # the lines the policy weighs drafts by, as each spec server had them after its case
    cost = "" if not step_costs else " The spec servers' step cost lines after their cases (decode: fixed + " \
        "per row; verify: fixed + per token): " + "; ".join(
            f"{TITLES[name]}: decode {c['decode'][0]:.1f} + {c['decode'][1]:.2f} ms, verify {c['verify'][0]:.1f} "
            f"+ {c['verify'][1]:.2f} ms" for name, c in step_costs.items()) + "."
    text = (f"\n## Speculative decoding (NGRAM) on an editing workload and a random trace, "
            f"{datetime.date.today().isoformat()}\n\n"
            f"`{command}`\n\n"
            f"Default model (SmolLM2-135M), {platform.machine()}, {os.cpu_count()} cores; load average "
            f"(1/5/15 min) {start} at the start, {end} at the end. `base`: launch.py {' '.join(BASE_FLAGS)}; "
            f"`spec`: the same plus {' '.join(spec_flags)}. Each case on a fresh base server, then a fresh spec "
            f"server (one warm-up request each, not in the case). Editing workload: chat completions, greedy, "
            f"max_tokens {args.max_tokens}, one user message each: return a repo source file with one name "
            f"changed, quote and summarise a docs paragraph, return a JSON object with one key renamed (seed "
            f"{args.seed}); random: ids, {args.random_input_len} +- {args.random_input_len // 2} in, "
            f"{args.random_output_len} out, EOS ignored. tok/s = output tokens / the case's duration; target = "
            f"the issue's spec/base (not asserted); ITL = median gap between streamed chunks (a chunk carries "
            f"a verify step's accepted tokens); TPOT = median per-token time after the first; verify steps, "
            f"accept rate (accepted / drafted) over the case, avg accept length (tokens a speculating row kept "
            f"per verify, the spec server's last 256 rows) from its /get_server_info; identical outputs = "
            f"answers equal, text for text, between the two servers. Where the spec server verified few or no "
            f"drafts it decoded as base does, and spec/base there is the machine's noise.{cost}\n\n{table}\n")
    if found:
        text += "\nAnswers that differ between the servers (where the texts part, 40 characters either side):\n\n"
        text += "\n".join(f"- {TITLES[m['case']]}, request {m['request']} ({m['source']}): at character {m['at_char']} "
                          f"(lengths {m['base_len']} / {m['spec_len']}): base `{m['base']!r}`, spec `{m['spec']!r}`"
                          for m in found) + "\n"
    if len({d for pair in digests.values() for d in pair.values()}) > 1:
        text += ("\nThe server's sources (" + ", ".join(SERVER_SOURCES) + ") changed during the run; their "
                 "digests at each server's start: " + "; ".join(
                     f"{TITLES[name]}: base {pair['base']}, spec {pair['spec']}" for name, pair in digests.items())
                 + ". Rows run on different code; a pair whose digests differ compares two versions.\n")
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 3 single, 8 concurrent requests, 32 random prompts, shorter outputs")
    p.add_argument("--single-requests", type=int, default=8)
    p.add_argument("--concurrent-requests", type=int, default=16, help="editing requests of the 8-concurrent case")
    p.add_argument("--random-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256, help="the editing requests' max_tokens")
    p.add_argument("--random-input-len", type=int, default=128, help="mean prompt tokens (+- half)")
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens of the spec server")
    p.add_argument("--server-flags", default="", help="more launch.py flags, for both servers")
    p.add_argument("--cases", nargs="+", default=list(TARGETS), choices=list(TARGETS), metavar="CASE",
                   help=f"of {', '.join(map(repr, TARGETS))}")
    p.add_argument("--llama-server", default="", metavar="PATH",
                   help="llama.cpp's llama-server: the single-stream case on it too, without and with its n-gram "
                        "speculation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    if args.quick:
        args.single_requests, args.concurrent_requests, args.random_prompts = 3, 8, 32
        args.max_tokens, args.random_output_len = 64, 32
    load_start = list(os.getloadavg())
    print(f"{platform.machine()}, {os.cpu_count()} cores; load average at the start "
          f"{' / '.join(f'{x:.2f}' for x in load_start)}", flush=True)

    from common.server_args import ServerArgs, default_model_path  # torch: not for --help
    from model_proc.weights import resolve_model_path

    gguf = default_model_path()
    tokenizer = bench_serving.load_client_tokenizer(resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir))
    cases = build_cases(args, tokenizer)
    flags = {"base": BASE_FLAGS + shlex.split(args.server_flags)}
    spec_flags = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    flags["spec"] = flags["base"] + spec_flags
    logs = tempfile.mkdtemp(prefix="spec_decode-")

    rows, results, found = [], [], []
    peers_table = ""  # --llama-server: llama.cpp beside ours on the single-stream case
    step_costs: dict[str, dict[str, list[float]]] = {}  # each spec server's cost line after its case
    digests: dict[str, dict[str, str]] = {}  # the server's sources at each server's start
    for case in cases:
        runs: dict[str, ServerRun] = {}
        for name in SERVERS:
            start = time.perf_counter()
            runs[name] = serve_case(flags[name], os.path.join(logs, f"{name}-{case.name.replace(' ', '_')}.log"),
                                    case, tokenizer, speculative=(name == "spec"))
            r = runs[name]
            print(f"{case.name}, {name}: {r.output_throughput:.1f} tok/s, ITL {r.median_itl_ms:.1f} ms, TPOT "
                  f"{r.median_tpot_ms:.1f} ms, {r.output_tokens} tokens in {r.duration_s:.1f} s, {r.failed} failed"
                  f"{' (' + r.first_error + ')' if r.failed else ''}; {time.perf_counter() - start:.0f} s with the "
                  f"server's start", flush=True)
        base, spec = runs["base"], runs["spec"]
        digests[case.name] = {name: r.source_digest for name, r in runs.items()}
        if base.source_digest != spec.source_digest:
            print(f"WARNING: the server's sources changed between the base and spec servers of {case.name}",
                  flush=True)
        diff = mismatches(case, base, spec)
        found += diff
        both = sum(1 for a, b in zip(base.texts, spec.texts) if a and b)
        s = spec.spec or {}
        if s.get("spec_step_cost_ms"):
            step_costs[case.name] = s["spec_step_cost_ms"]
        ratio = spec.output_throughput / base.output_throughput if base.output_throughput else float("nan")
        rows.append([TITLES[case.name], str(len(case.rows)), f"{base.output_throughput:.1f}",
                     f"{spec.output_throughput:.1f}", f"{ratio:.2f}x", f">= {TARGETS[case.name]:.2f}x",
                     f"{base.median_itl_ms:.1f}", f"{spec.median_itl_ms:.1f}", f"{base.median_tpot_ms:.1f}",
                     f"{spec.median_tpot_ms:.1f}",
                     str(s.get("spec_verify_steps", "-")),
                     # no verify in the case: the server's window holds only the warm-up's rows
                     *([f"{s['accept_rate']:.2f}", f"{s['avg_spec_accept_length']:.2f}"]
                       if s.get("spec_verify_steps") else ["-", "-"]),
                     f"{both - len(diff)}/{len(case.rows)}"])
        results.append({"case": case.name, "requests": len(case.rows), "concurrency": case.concurrency,
                        "ratio": ratio, "target": TARGETS[case.name], "identical": both - len(diff),
                        "sources": case.sources,
                        **{name: {k: v for k, v in asdict(r).items() if k != "texts"} for name, r in runs.items()}})
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        for m in diff:
            print(f"MISMATCH {m}", flush=True)
        if case.name == "single" and args.llama_server:
            llama = {name: serve_case_llama(args.llama_server, extra, gguf, os.path.join(
                logs, f"{name.replace(' ', '_')}-single.log"), case, tokenizer) for name, extra in LLAMA_SERVERS.items()}
            peers_table = llama_table(llama, runs)
            print(peers_table, flush=True)
            results[-1]["llama.cpp"] = {name: {k: v for k, v in asdict(r).items() if k != "texts"}
                                        for name, r in llama.items()}

    load_end = list(os.getloadavg())
    command = "python -m bench.serving.spec_decode " + shlex.join(sys.argv[1:] if argv is None else argv)
    text = report(command.rstrip(), rows, found, (load_start, load_end), args, spec_flags, step_costs, digests)
    if peers_table:
        text += (f"\nThe single-stream case on llama.cpp's llama-server ({args.llama_server}; the same GGUF, "
                 f"`-t {os.cpu_count()} -c 8192 -np 1`), without and with its n-gram speculation (`--spec-type "
                 f"ngram-simple`, its defaults), beside ours from the table above:\n\n{peers_table}\n")
    print(text)
    print(f"server logs: {logs}")
    data = {"cases": results, "mismatches": found}
    if not args.no_write:
        record_run(text, "bench.serving.spec_decode", data=data,
                   load_average=LoadAverage([round(x, 2) for x in load_start], [round(x, 2) for x in load_end]))
    return data


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
