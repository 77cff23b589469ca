"""bench/linear_bench.py runs each kernel this machine has and reports them side by side."""

from __future__ import annotations

import pytest
import torch

from bench import linear_bench
from model_proc.layers import native_layers_op


def test_every_available_kernel_is_timed_and_compared(capsys):
    linear_bench.main(["--rows", "1", "3", "--steps", "1", "--kernels", "torch", "onednn", "native",
                       "--no-write"])
    out = capsys.readouterr().out
    table = out[out.index("| rows |"):]
    header = table.splitlines()[0]
    assert header.startswith("| rows | torch ms (GB/s)")
    assert [line.split(" | ")[0] for line in table.splitlines()[2:4]] == ["| 1", "| 3"]
    for kernel in ("onednn", "native"):
        assert (f"{kernel} / torch" in header) != (f"skipped: no {kernel} matmul" in out)


def test_native_pages_both_times_the_weights_on_huge_and_4k_pages(capsys):
    linear_bench.main(["--rows", "2", "--steps", "1", "--kernels", "native", "--native-pages", "huge", "4k",
                       "--no-write"])
    out = capsys.readouterr().out
    if "skipped: no native matmul" in out:
        pytest.skip("no native matmul here: needs AVX512_BF16 or AMX and a C++ compiler")
    header = out[out.index("| rows |"):].splitlines()[0]
    assert header == "| rows | native ms (GB/s) | native-4k ms (GB/s) | native-4k / native |"


def test_native_amx_both_times_the_amx_loop_and_brgemm_and_leaves_the_default_on(capsys):
    linear_bench.main(["--rows", "20", "--steps", "1", "--kernels", "native", "--native-amx", "on", "off",
                       "--no-write"])
    out = capsys.readouterr().out
    if "skipped: no native matmul" in out:
        pytest.skip("no native matmul here: needs AVX512_BF16 or AMX and a C++ compiler")
    header = out[out.index("| rows |"):].splitlines()[0]
    assert header == "| rows | native ms (GB/s) | native-brgemm ms (GB/s) | native-brgemm / native |"
    # the process-wide switch is back on, as the model runs
    assert native_layers_op(torch.device("cpu")).amx_enabled()
