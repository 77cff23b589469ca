"""Triton kernels on a CPU-only machine run in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernels/
module is first imported, so it is set here, at conftest import time, before
any test module can import one. (Nothing outside kernels/ imports triton at
import time; the triton attention backend imports kernels/ lazily.)

The interpreter computes bfloat16 wrongly (numpy has no bfloat16), so these
tests use float32 and float16; bench/gpu_check.py covers bfloat16 on a GPU.
"""

from __future__ import annotations

import os
import secrets

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs on every run; the seed is printed, so that a
    failure can be replayed with KERNEL_TEST_SEED=<seed>."""
    seed = int(os.environ.get("KERNEL_TEST_SEED") or secrets.randbits(31))
    print(f"KERNEL_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
