"""What this machine can do, measured on the spot: the rates a floor is computed from."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from model_proc.layers import onednn_supports


def timed_calls(fn: Any, calls: int, stat: str = "min", warmups: int = 1) -> float:
    """`stat` (min or median) seconds of `calls` calls of fn after `warmups` untimed ones."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) if stat == "median" else min(times)


def best_seconds(fn: Any, repeat: int) -> float:
    return timed_calls(fn, repeat)


def read_bandwidth() -> float:
    """Bytes/s: the best `sum` over a 512 MiB float32 tensor (pages touched first)."""
    x = torch.ones(2**27)
    seconds = best_seconds(lambda: x.sum(), repeat=7)
    return x.numel() * x.element_size() / seconds


def matmul_rate(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of the best n^3 matmul in `dtype`: torch.mm or a pre-packed oneDNN linear."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    with torch.inference_mode():
        seconds = best_seconds(lambda: torch.mm(a, b), repeat=5)
        if onednn_supports(torch.device("cpu"), dtype):  # bfloat16 needs AVX512 (or AVX-NE-CONVERT)
            packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
            seconds = min(seconds, best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeat=5))
    return 2 * n**3 / seconds
