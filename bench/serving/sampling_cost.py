"""What a JSON schema and penalties cost a user in decode throughput, served side by side.

    python -m bench.serving.sampling_cost                    # batch 1 and 16, 3 rounds: ~4 min on 2 quiet cores
    python -m bench.serving.sampling_cost --batches 1 16 --rounds 3 --append-results

One server of ours (launch.py, default flags plus --max-running-requests the
largest batch), one client (bench/serving/bench_serving's, OpenAI /v1/completions,
streamed). For each batch size B, B requests are sent at once in three cases
that take turns, --rounds times, so a change in the machine's load hits all
alike:
- `plain`: --output-len tokens, ignore_eos;
- `penalties`: the same, with frequency_penalty 0.5, presence_penalty 0.5,
  repetition_penalty 1.1 and a logit_bias on every row;
- `json_schema`: SGLang's json_schema field with a schema whose every answer
  is a JSON array of exactly --json-items integers in [100, 999] (about five
  tokens an item with this tokenizer, so its length is close to plain's);
  the grammar ends it.
Decode throughput of a case is B / its median inter-token latency (every
streamed token of every request, all rounds): the rate at which the batch
produces tokens once it is decoding, whatever the answer lengths. Each row
also checks what it measured: every json_schema answer parses and has
--json-items integers.

Writes --out-dir/sampling_cost.json and .md; with --record the run is also
recorded (bench/results/latest/sampling_cost.json, from which bench/RESULTS.md
is rendered again). Targets (issue 14): json_schema within
15% of plain, penalties within 5%, at batch 1 and 16.

Output: bench/results/sampling_cost.json, sampling_cost.md; --record: its record
bench/results/latest/sampling_cost.json and bench/RESULTS.md (rendered again)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from typing import Any, Sequence

from bench.lib.backends import RequestConfig
from bench.serving.bench_serving import load_client_tokenizer, run_benchmark
from bench.lib.cpu_pressure import CpuWait, add_quiet_cpu_args, wait_for_quiet
from bench.lib.datasets import DatasetRow
from bench.lib.run_record import LoadAverage
from bench.lib.server_launcher import LaunchedServer
from bench.lib.study_report import machine_line, write_report

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
CASES = ("plain", "penalties", "json_schema")
PROMPT = "Here is a list of three-digit numbers, as JSON:"
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": {"11": 2.0, "42": -5.0}}
TARGETS = {"penalties": 0.05, "json_schema": 0.15}  # the largest throughput loss allowed


def json_schema(items: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
            "minItems": items, "maxItems": items}


def extra_body(case: str, items: int) -> dict[str, Any]:
    if case == "penalties":
        return dict(PENALTIES)
    if case == "json_schema":
        return {"json_schema": json.dumps(json_schema(items)), "ignore_eos": False}
    return {}


def check_json_answers(texts: Sequence[str], items: int) -> int:
    """How many answers are not a JSON array of `items` integers (0 expected)."""
    bad = 0
    for t in texts:
        try:
            doc = json.loads(t)
            bad += not (isinstance(doc, list) and len(doc) == items and all(isinstance(x, int) for x in doc))
        except ValueError:
            bad += 1
    return bad


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128, help="plain and penalties: tokens per answer")
    p.add_argument("--json-items", type=int, default=26,
                   help="json_schema: integers per answer (SmolLM2 spells digits one token each: ~5 tokens "
                        "an item, so 26 items are about plain's 128 tokens)")
    p.add_argument("--server-args", default="", help="extra flags for launch.py")
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--record", "--append-results", dest="record", action="store_true",
                   help="record the run: bench/results/latest/sampling_cost.json, and bench/RESULTS.md rendered "
                        "again (--append-results: its name when it appended to bench/RESULTS.md)")
    add_quiet_cpu_args(p, "each batch size", retries=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    flags = ["--max-running-requests", str(max(args.batches)), *args.server_args.split()]
    log = os.path.join(tempfile.mkdtemp(prefix="sampling_cost_"), "server.log")
    server = LaunchedServer.ours(flags, log).start()
    rows: list[dict[str, Any]] = []
    try:
        info = json.loads(_get(server.url + "/get_model_info"))
        tokenizer = load_client_tokenizer(info["model_path"])
        for b in args.batches:
            load_start = os.getloadavg()[0]
            wait_for_quiet(args.quiet_threshold, args.quiet_timeout)
            itls: dict[str, list[float]] = {c: [] for c in CASES}
            tokens: dict[str, list[int]] = {c: [] for c in CASES}
            bad_json = 0
            with CpuWait() as wait:
                for _ in range(args.rounds):
                    for case in CASES:
                        cfg = RequestConfig(backend="openai", base_url=server.url, model=info["served_model_name"],
                                            extra_body=extra_body(case, args.json_items))
                        # room for any spelling of the array: the grammar, not the limit, ends it
                        max_tokens = 8 * args.json_items + 8 if case == "json_schema" else args.output_len
                        data = [DatasetRow(PROMPT, 0, max_tokens)] * b
                        out = run_benchmark(cfg, data, [0.0] * b, tokenizer, disable_tqdm=True)
                        if out["completed"] != b:
                            raise RuntimeError(f"{case}: {b - out['completed']} requests failed: {out['errors']}")
                        itls[case] += [gap for per_req in out["itls"] for gap in per_req]
                        tokens[case] += out["output_lens"]
                        if case == "json_schema":
                            bad_json += check_json_answers(out["generated_texts"], args.json_items)
            row: dict[str, Any] = {"batch": b, "load_start": load_start, "load_end": os.getloadavg()[0],
                                   "cpu_wait": wait.share, "bad_json_answers": bad_json}
            for case in CASES:
                itl = statistics.median(itls[case])
                row[f"{case}_itl_ms"] = 1e3 * itl
                row[f"{case}_tok_s"] = b / itl
                row[f"{case}_tokens"] = statistics.median(tokens[case])
            for case in ("penalties", "json_schema"):
                row[f"{case}_ratio"] = row[f"{case}_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            print(_row_line(row), flush=True)
    finally:
        server.stop()
    result = {"command": "python -m bench.serving.sampling_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "machine": machine_line(), "rows": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sampling_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    load = LoadAverage([round(rows[0]["load_start"], 2)], [round(rows[-1]["load_end"], 2)]) if rows else None
    write_report(lambda _: markdown(result), os.path.join(args.out_dir, "sampling_cost.md"),
                 "bench.serving.sampling_cost" if args.record else None, data=rows, load_average=load)
    return result


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _row_line(r: dict[str, Any]) -> str:
    return (f"batch {r['batch']:3d}: plain {r['plain_tok_s']:.1f} tok/s, penalties {r['penalties_tok_s']:.1f} "
            f"({r['penalties_ratio']:.3f}x), json_schema {r['json_schema_tok_s']:.1f} "
            f"({r['json_schema_ratio']:.3f}x); bad json answers {r['bad_json_answers']}; "
            f"load {r['load_start']:.1f} -> {r['load_end']:.1f}")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"## Decode cost of a JSON schema and of penalties, {result['date']}", "",
             f"`{result['command']}`", "", result["machine"], "",
             "Decode throughput = batch / median inter-token latency (every streamed token, all rounds); "
             "the cases take turns on one server.", "",
             "| batch | plain tok/s (ITL ms) | penalties tok/s (x plain) | json_schema tok/s (x plain) "
             "| answer tokens plain / json | bad json answers | load avg start / end | CPU wait |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['plain_tok_s']:.1f} ({r['plain_itl_ms']:.1f}) | {r['penalties_tok_s']:.1f} "
            f"({r['penalties_ratio']:.3f}) | {r['json_schema_tok_s']:.1f} ({r['json_schema_ratio']:.3f}) | "
            f"{r['plain_tokens']:.0f} / {r['json_schema_tokens']:.0f} | {r['bad_json_answers']} | "
            f"{r['load_start']:.1f} / {r['load_end']:.1f} | "
            f"{'-' if r['cpu_wait'] is None else format(r['cpu_wait'], '.0%')} |")
    met = [f"{case} at batch {r['batch']}: {1 - r[f'{case}_ratio']:+.1%} loss (target <= {TARGETS[case]:.0%}): "
           f"{'met' if 1 - r[f'{case}_ratio'] <= TARGETS[case] else 'missed'}"
           for r in result["rows"] for case in TARGETS]
    lines += ["", "Targets (issue 14): " + "; ".join(met) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
