"""Triton kernels on a CPU-only machine run in Triton's interpreter.

TRITON_INTERPRET is read when triton.language is first imported and when a
kernel is decorated, so tests/conftest.py sets it before any test module is
collected (sglang's frontend, imported by an e2e test module, imports triton;
the triton attention backend imports kernels/ lazily).

The interpreter computes bfloat16 wrongly (numpy has no bfloat16), so these
tests use float32 and float16; tests/gpu/gpu_check.py covers bfloat16 on a GPU.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs on every run; the seed is printed, so that a
    failure can be replayed with KERNEL_TEST_SEED=<seed>."""
    seed = int(os.environ.get("KERNEL_TEST_SEED") or secrets.randbits(31))
    print(f"KERNEL_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
