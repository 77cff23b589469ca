"""Small launch-time helpers shared by the kernels (no Triton code here)."""

from __future__ import annotations

import torch
import triton


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision. float32 on a GPU would otherwise go through
    tf32 (a 10-bit mantissa): a float32 model asked for float32 attention."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_dim(n: int) -> int:
    """Padded tile size for a head dimension: a power of two (tl.arange), and
    at least 16, the smallest tl.dot operand."""
    return max(16, triton.next_power_of_2(n))
