"""What this machine can do, measured on the spot: the rates a floor is computed from."""

from __future__ import annotations

import time
from typing import Any

import torch


def best_seconds(fn: Any, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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
        if torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
            seconds = min(seconds, best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeat=5))
    return 2 * n**3 / seconds
