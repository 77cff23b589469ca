"""tests/gpu/gpu_check.py, the Triton kernels on a real GPU, as a test: run as
its own process with --quick (it exits non-zero when any check fails).
Needs a CUDA device; skipped where there is none."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: torch.cuda.is_available() is false "
                              "(run `python -m tests.gpu.gpu_check --quick` on a GPU machine)"),
]


def test_gpu_check_quick_passes() -> None:
    # compiled kernels: without the interpreter tests/conftest.py turns on for this process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.gpu_check", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
