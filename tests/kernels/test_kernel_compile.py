"""The kernels compile for a Hopper GPU (sm_90) on this CPU-only machine,
bfloat16 included: the compiler's checks that the interpreter skips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    # a subprocess: compiling needs a process where TRITON_INTERPRET was never set
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
