"""Matmuls on GGUF-quantized weights (model_proc/quant) beside float32 ones.

    python -m bench.micro.quant_bench [--rows 1 4 16 64] [--types Q4_0 Q8_0 ...] [--calls 9]
                                      [--threads 1 --clock thread] [--stat min]
                                      [--paths quant_matmul gemv tiles q8] [--no-float]

For the matmul shapes (N outputs x K inputs) of a 1B Llama, of the default
model (SmolLM2-135M) and of Gemma 3 270M's Q5_0 ones (K = 640), at each number
of x rows: the median ms of float32 F.linear, of oneDNN's pre-packed float32
weight (model_proc/layers.py Linear's kernel), and of quant_matmul for each
GGUF type (the native gemv up to matmul.GEMV_MAX_ROWS rows, dequantized tiles
and torch.mm above). K-quants need K a multiple of 256: none of them for K =
576 or 640 (where llama.cpp's Q4_K_M files fall back to Q5_0).

`--paths` times quant_matmul's ways apart, a column each per type: "gemv"
the float-activation native gemv at every row count, "tiles" the dequantized
tiles and torch.mm at every row count, "q8" the 8-bit-activation kernel
(model_proc/quant/int8_act.py's quant_matmul_q8: x quantized, then gemv_q8;
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K); "quant_matmul" (the default) is the column
named by the type alone. `--no-float` leaves out float32 F.linear and oneDNN.

Every call reads its weight from memory, as a decode step does: each kernel
cycles through copies of its weight that together outgrow the L3 cache. The
floor beside each time is the weight's bytes over the read bandwidth measured
on the spot (bench.lib.machine_rates.read_bandwidth); "x floor" is the time
over it. Prints the table only (bench/RESULTS.md is left alone).

On a machine other work is loading, a thread that loses its core stalls a
parallel call for a whole time slice (the medians become 8-12 ms); `--threads
1 --clock thread` then times one thread by its own CPU time (time.thread_time),
which leaves out the time it waited, and the floor is one thread's read bandwidth;
or `--stat min` reports each kernel's fastest call (one the others left alone).

Output: stdout only (the table; bench/RESULTS.md is left alone)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.lib.machine_rates import read_bandwidth
from model_proc.layers import PACK_HINT_ROWS, onednn_supports
from model_proc import native
from model_proc.quant import int8_act, matmul
from model_proc.quant.ggml_types import GGMLType, block_shape, fp16_fields, row_bytes
from model_proc.quant.matmul import GEMV_MAX_ROWS, quant_matmul

SHAPES = {  # name: (N, K)
    "llama1b q/o": (2048, 2048), "llama1b k/v": (512, 2048), "llama1b up": (8192, 2048),
    "llama1b down": (2048, 8192),
    "smol q/o": (576, 576), "smol up": (1536, 576), "smol down": (576, 1536), "smol head": (49152, 576),
    "gemma3 q": (1024, 640), "gemma3 up": (2048, 640), "head 49152x2048": (49152, 2048),
}
PATHS = ["quant_matmul", "gemv", "tiles", "q8"]
TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
         GGMLType.Q6_K]
COPIES_BYTES = 96 << 20  # L3 here is 32 MiB


def copies_for(nbytes: int) -> int:
    return max(1, -(-COPIES_BYTES // nbytes))


def random_blocks(qtype: GGMLType, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: random codes, finite fp16 scales (~0.01)."""
    weights, nbytes = block_shape(qtype)
    blocks = torch.randint(0, 256, (n, k // weights, nbytes), dtype=torch.uint8, generator=gen)
    for off in fp16_fields(qtype):
        scales = (torch.randn(n, k // weights, 1, generator=gen) * 0.01).half()
        blocks[..., off:off + 2] = scales.view(torch.uint8)
    return blocks.view(n, row_bytes(qtype, k))


clock = time.perf_counter  # or time.thread_time (--clock thread)
stat = statistics.median    # or min (--stat min)


def median_ms(fn: Callable[[], object], calls: int) -> float:
    """ms of one call: the median (or --stat's) over `calls` after a warm-up."""
    fn()  # warm-up
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * stat(times)


def cycling(items: list, call: Callable) -> Callable[[], object]:
    """A call on the next item each time (round robin)."""
    state = {"i": 0}

    def step() -> object:
        state["i"] = (state["i"] + 1) % len(items)
        return call(items[state["i"]])
    return step


def column(qtype: GGMLType, path: str) -> str:
    return qtype.name if path == "quant_matmul" else f"{qtype.name} {path}"


def path_call(path: str, qtype: GGMLType, k: int) -> Callable[[torch.Tensor, torch.Tensor], object] | None:
    """(x, blocks) -> y by one of quant_matmul's ways, or None where it does not apply here."""
    if path == "quant_matmul":
        return lambda x, b: quant_matmul(x, b, qtype, k)
    if path == "gemv":
        op = native.load(name="quant")
        return None if op is None else (lambda x, b: op.gemv(x, b, int(qtype)))
    if path == "tiles":
        def tiles(x: torch.Tensor, b: torch.Tensor) -> object:
            saved, matmul.GEMV_MAX_ROWS = matmul.GEMV_MAX_ROWS, 0
            try:
                return quant_matmul(x, b, qtype, k)
            finally:
                matmul.GEMV_MAX_ROWS = saved
        return tiles
    if not int8_act.available(qtype):
        return None
    return lambda x, b: int8_act.quant_matmul_q8(x, b, qtype, k)


@torch.inference_mode()
def time_shape(n: int, k: int, rows: list[int], types: list[GGMLType], calls: int, gen: torch.Generator,
               paths: list[str] = ("quant_matmul",), floats: bool = True,
               ) -> tuple[dict[tuple[str, int], float], dict[str, int]]:
    """{(kernel, rows): median ms}, {kernel: weight bytes} for one shape."""
    times: dict[tuple[str, int], float] = {}
    sizes: dict[str, int] = {}
    xs = {m: torch.randn(m, k, generator=gen) for m in rows}
    if floats:
        time_floats(n, k, rows, calls, gen, xs, times, sizes)
    for qtype in types:
        if k % block_shape(qtype)[0]:
            continue
        nbytes = n * row_bytes(qtype, k)
        blocks = [random_blocks(qtype, n, k, gen) for _ in range(copies_for(nbytes))]
        for path in paths:
            call = path_call(path, qtype, k)
            if call is None:
                continue
            sizes[column(qtype, path)] = nbytes
            for m in rows:
                times[(column(qtype, path), m)] = median_ms(cycling(blocks, lambda b: call(xs[m], b)), calls)
    return times, sizes


def time_floats(n: int, k: int, rows: list[int], calls: int, gen: torch.Generator, xs: dict[int, torch.Tensor],
                times: dict[tuple[str, int], float], sizes: dict[str, int]) -> None:
    """float32 F.linear and oneDNN's packed weight, into times and sizes."""
    weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies_for(4 * n * k))]
    sizes["f32"] = sizes["onednn"] = 4 * n * k
    for m in rows:
        times[("f32", m)] = median_ms(cycling(weights, lambda w: F.linear(xs[m], w)), calls)
    if onednn_supports(torch.device("cpu"), torch.float32):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in weights]
        del weights
        for m in rows:
            times[("onednn", m)] = median_ms(cycling(
                packed, lambda p: torch.ops.mkldnn._linear_pointwise(xs[m], p, None, "none", [], "")), calls)
        del packed
    else:
        del weights


def table(results: dict[str, tuple[dict, dict]], rows: list[int], kernels: list[str], bandwidth: float) -> str:
    """Per shape and rows: each kernel's median ms and its time over the floor (bytes / bandwidth)."""
    lines = ["| shape (N x K) | rows | " + " | ".join(f"{k} ms (x floor)" for k in kernels) + " |",
             "|---|---|" + "---|" * len(kernels)]
    for name, (times, sizes) in results.items():
        n, k = SHAPES[name]
        for m in rows:
            cells = []
            for kernel in kernels:
                if (kernel, m) not in times:
                    cells.append("-")
                    continue
                floor_ms = 1e3 * sizes[kernel] / bandwidth
                cells.append(f"{times[(kernel, m)]:.3f} ({times[(kernel, m)] / floor_ms:.1f})")
            lines.append(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |")
    lines += ["", "Weight bytes (MB) and their floor (ms at the measured read bandwidth):", "",
              "| shape | " + " | ".join(kernels) + " |", "|---|" + "---|" * len(kernels)]
    for name, (_, sizes) in results.items():
        cells = [f"{sizes[k] / 1e6:.2f} ({1e3 * sizes[k] / bandwidth:.3f})" if k in sizes else "-" for k in kernels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--types", nargs="+", choices=[t.name for t in TYPES], default=[t.name for t in TYPES])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--calls", type=int, default=9, help="timed calls per kernel, shape and rows (median)")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="wall: time.perf_counter; thread: this thread's CPU time (one thread only)")
    p.add_argument("--stat", choices=["median", "min"], default="median", help="of each kernel's calls")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=["quant_matmul"],
                   help="quant_matmul's ways, a column each per type (see above)")
    p.add_argument("--no-float", action="store_true", help="leave out float32 F.linear and oneDNN")
    args = p.parse_args(argv)
    global clock, stat
    stat = min if args.stat == "min" else statistics.median
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if torch.get_num_threads() != 1:
            p.error("--clock thread times this thread alone: give --threads 1")
        clock = time.thread_time
    types = [GGMLType[t] for t in args.types]
    load0 = os.getloadavg()
    bandwidth = read_bandwidth()
    gen = torch.Generator().manual_seed(0)
    results = {}
    for name in args.shapes:
        results[name] = time_shape(*SHAPES[name], args.rows, types, args.calls, gen, args.paths, not args.no_float)
        print(f"  {name} done", flush=True)
    load1 = os.getloadavg()
    floats = [] if args.no_float else ["f32"] + (["onednn"] if onednn_supports(torch.device("cpu"), torch.float32)
                                                 else [])
    kernels = floats + [c for t in types for c in (column(t, p) for p in args.paths)
                        if any(c == kernel for times, _ in results.values() for kernel, _ in times)]
    print(f"\n{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.clock} clock, {args.stat} of {args.calls} calls; read bandwidth {bandwidth / 1e9:.1f} GB/s (best `sum` over 512 MiB); quant_matmul's gemv up to "
          f"{GEMV_MAX_ROWS} rows; load average (1, 5, 15 min) {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the "
          f"start, {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end\n")
    print(table(results, args.rows, kernels, bandwidth))


if __name__ == "__main__":
    main()
