"""The model's matmuls alone, per kernel: what `Linear` runs on this CPU.

    python -m bench.micro.linear_bench [--dtype bfloat16] [--rows 1 8 32 64 256 1024]
                                 [--kernels native onednn torch] [--native-pages huge 4k]
                                 [--native-amx on off] [--no-write]

One "step" is every matmul of the default model's 30 layers and its LM head,
in the model's order and with the model's epilogues (q/k/v; o_proj + the
residual; gate/up with SiLU(gate) * up; down_proj + the residual; the head),
on random weights of the model's shapes, for `rows` tokens. The weights
(~270 MB in bfloat16) are far beyond the caches, so every step reads them
from memory as a decode step does. Kernels (model_proc/layers.py
MatmulKernel): the native op's packed blocks, oneDNN's pre-packed weight,
plain F.linear. The native op's weights sit where the model puts them, in
one buffer on transparent huge pages (layers.move_packed_onto_huge_pages);
`--native-pages huge 4k` also times them on ordinary 4 KiB pages
("native-4k"); `--native-amx on off` also times the native op with
brgemm taking the calls of 17-64 rows its own AMX loop takes in the model
("native-brgemm"). The kernels take turns, case by case, twice; the median of
each kernel's timed steps is reported, with the weights' read rate and, next
to it, the read bandwidth measured on the spot. The table is printed and the
run recorded, with the command and date: bench/results/latest/linear_bench.json,
from which bench/RESULTS.md is rendered again.

Output: its record bench/results/latest/linear_bench.json and bench/RESULTS.md (rendered again);
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
from dataclasses import dataclass

import torch

from bench.lib.machine_rates import read_bandwidth
from bench.lib.run_record import LoadAverage, record_run
from model_proc import layers
from model_proc.layers import Linear, MatmulKernel, native_layers_op, onednn_supports

HIDDEN, INTER, Q, KV, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152  # SmolLM2-135M


def make_model(kernel: MatmulKernel, dtype: torch.dtype, seed: int, huge_pages: bool = True) -> list[list[Linear]]:
    """30 layers of [qkv, o, gate_up, down], then [head], prepared for `kernel`
    (the native op's weights moved onto huge pages, as the model does, unless
    `huge_pages` is False)."""
    layers.use_native, Linear.use_onednn = kernel is MatmulKernel.NATIVE, kernel is MatmulKernel.ONEDNN
    gen = torch.Generator().manual_seed(seed)

    def linear(k: int, n: int, gated: bool = False) -> Linear:
        lin = Linear(k, n, bias=False, gated=gated)
        with torch.no_grad():
            lin.weight = torch.nn.Parameter((torch.randn(n, k, generator=gen) * 0.05).to(dtype), requires_grad=False)
        lin.prepare()
        assert lin.kernel is kernel, (lin.kernel, kernel)
        return lin

    try:
        model = [[linear(HIDDEN, Q + 2 * KV), linear(Q, HIDDEN), linear(HIDDEN, 2 * INTER, gated=True),
                  linear(INTER, HIDDEN)] for _ in range(LAYERS)] + [[linear(HIDDEN, VOCAB)]]
        if huge_pages:
            layers.move_packed_onto_huge_pages([lin for layer in model for lin in layer])
        return model
    finally:
        layers.use_native, Linear.use_onednn = True, True


def step(model: list[list[Linear]], x: torch.Tensor) -> None:
    for qkv, o, gate_up, down in model[:-1]:
        attn_out = qkv(x)[:, :Q]  # stands in for attention's output: q's width
        h = o(attn_out, add=x)
        down(gate_up(h), add=h)
    model[-1][0](x)


def weight_bytes(dtype: torch.dtype) -> int:
    per_layer = HIDDEN * (Q + 2 * KV) + Q * HIDDEN + HIDDEN * 2 * INTER + INTER * HIDDEN
    return (LAYERS * per_layer + HIDDEN * VOCAB) * torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class Variant:
    """A kernel, and for the native one where its weights sit and whether its
    own AMX loop takes the calls of 17-64 rows (else brgemm takes them all)."""
    kernel: MatmulKernel
    huge_pages: bool = True
    amx: bool = True

    @property
    def value(self) -> str:  # the label in the table
        if self.kernel is not MatmulKernel.NATIVE:
            return self.kernel.value
        return self.kernel.value + ("" if self.huge_pages else "-4k") + ("" if self.amx else "-brgemm")

    def select(self) -> None:
        """Switch the native op to this variant's loop (a process-wide setting)."""
        op = native_layers_op(torch.device("cpu")) if self.kernel is MatmulKernel.NATIVE else None
        if op is not None:  # None: no native matmul on this processor (nothing to switch)
            op.set_amx(self.amx)


@torch.inference_mode()
def run(dtype: torch.dtype, rows: list[int], kernels: list[Variant], steps: int) -> dict:
    models = {k: make_model(k.kernel, dtype, seed=0, huge_pages=k.huge_pages) for k in kernels}
    gen = torch.Generator().manual_seed(1)
    times: dict[tuple[Variant, int], list[float]] = {}
    for n in rows:
        x = torch.randn(n, HIDDEN, generator=gen).to(dtype)
        for _ in range(2):  # the kernels take turns, twice
            for k in kernels:
                k.select()
                step(models[k], x)  # warm-up
                for _ in range(steps):
                    start = time.perf_counter()
                    step(models[k], x)
                    times.setdefault((k, n), []).append(time.perf_counter() - start)
        Variant(MatmulKernel.NATIVE).select()  # back to the default
        print("  rows %5d: " % n + ", ".join(f"{k.value} {1e3 * statistics.median(times[(k, n)]):.2f} ms"
                                             for k in kernels), flush=True)
    return {key: statistics.median(v) for key, v in times.items()}


def report(command: str, dtype: torch.dtype, rows: list[int], kernels: list[Variant], medians: dict,
           bandwidth: float, load: tuple[float, float]) -> str:
    gb = weight_bytes(dtype) / 1e9
    first = kernels[0]
    lines = [f"## The model's matmuls per kernel, {datetime.date.today().isoformat()}", "", f"`{command}`", "",
             f"SmolLM2-135M's matmul shapes (30 layers + the LM head, {gb * 1e3:.0f} MB of {dtype_name(dtype)} "
             f"weights, random values), the model's epilogues, {platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads. Median step over both turns of each "
             f"kernel. Read bandwidth measured on the spot: {bandwidth / 1e9:.1f} GB/s (best `sum` over 512 MiB); "
             f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end.", "",
             "| rows | " + " | ".join(f"{k.value} ms (GB/s)" for k in kernels) + " | "
             + " | ".join(f"{k.value} / {first.value}" for k in kernels[1:]) + " |",
             "|---|" + "---|" * (2 * len(kernels) - 1)]
    for n in rows:
        cells = [f"{1e3 * medians[(k, n)]:.2f} ({gb / medians[(k, n)]:.1f})" for k in kernels]
        ratios = [f"{medians[(k, n)] / medians[(first, n)]:.2f}" for k in kernels[1:]]
        lines.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available(kernel: MatmulKernel, dtype: torch.dtype) -> bool:
    cpu = torch.device("cpu")
    if kernel is MatmulKernel.NATIVE:
        return native_layers_op(cpu, dtype) is not None
    return kernel is MatmulKernel.TORCH or onednn_supports(cpu, dtype)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024])
    p.add_argument("--kernels", nargs="+", choices=[k.value for k in MatmulKernel],
                   default=[k.value for k in MatmulKernel if k is not MatmulKernel.TORCH])
    p.add_argument("--native-pages", nargs="+", choices=["huge", "4k"], default=["huge"],
                   help="where the native op's weights sit: huge pages (as in the model), 4 KiB pages, or both")
    p.add_argument("--native-amx", nargs="+", choices=["on", "off"], default=["on"],
                   help="whether the native op's own AMX loop takes 17-64 rows (on, as in the model) or brgemm "
                        "takes every call (off), or both")
    p.add_argument("--steps", type=int, default=5, help="timed steps per kernel and turn")
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    native = MatmulKernel.NATIVE.value
    kernels = [Variant(MatmulKernel(k), page == "huge", amx == "on") for k in args.kernels
               for page in (args.native_pages if k == native else ["huge"])
               for amx in (args.native_amx if k == native else ["on"])]
    skipped = [k for k in kernels if not available(k.kernel, dtype)]
    for k in skipped:
        print(f"skipped: no {k.value} matmul for {args.dtype} on this machine")
    kernels = [k for k in kernels if k not in skipped]
    if not kernels:
        sys.exit("no kernel to time")
    load0 = os.getloadavg()[0]
    bandwidth = read_bandwidth()
    medians = run(dtype, args.rows, kernels, args.steps)
    command = "python -m bench.micro.linear_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    load = (load0, os.getloadavg()[0])
    text = report(command.strip(), dtype, args.rows, kernels, medians, bandwidth, load)
    print("\n" + text)
    if not args.no_write:
        rows = [{"rows": n, "kernel": k.value, "ms": round(1e3 * medians[(k, n)], 3)} for n in args.rows for k in kernels]
        record_run(text, "bench.micro.linear_bench", data=rows, load_average=LoadAverage([load[0]], [load[1]]),
                   floors={"read_bandwidth_gbs": round(bandwidth / 1e9, 2)})


if __name__ == "__main__":
    main()
