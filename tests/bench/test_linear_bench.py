"""bench/micro/linear_bench.py runs each kernel this machine has and reports them side by side."""

from __future__ import annotations

import pytest
import torch

from bench.micro import linear_bench
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


@pytest.mark.parametrize("flag,rows,other", [("--native-pages huge 4k", "2", "native-4k"),
                                             ("--native-amx on off", "20", "native-brgemm")],
                         ids=["huge-and-4k-pages", "amx-loop-and-brgemm"])
def test_a_native_option_given_both_values_times_both_side_by_side(capsys, flag, rows, other):
    """--native-pages huge 4k: the weights on huge and on 4 KiB pages;
    --native-amx on off: 17-64 rows on the op's AMX loop and on brgemm (the
    switch is back on afterwards, as the model runs)."""
    if native_layers_op(torch.device("cpu"), torch.bfloat16) is None:
        pytest.skip("no native matmul here: needs AVX512_BF16 or AMX and a C++ compiler")
    linear_bench.main(["--rows", rows, "--steps", "1", "--kernels", "native", *flag.split(), "--no-write"])
    out = capsys.readouterr().out
    header = out[out.index("| rows |"):].splitlines()[0]
    assert header == f"| rows | native ms (GB/s) | {other} ms (GB/s) | {other} / native |"
    assert native_layers_op(torch.device("cpu")).amx_enabled()


def test_a_recorded_run_keeps_each_kernels_median_and_the_bandwidth(recorded):
    linear_bench.main(["--rows", "1", "3", "--steps", "1", "--kernels", "torch"])
    record = recorded.check("bench.micro.linear_bench")
    assert record.title == "The model's matmuls per kernel"
    assert [(r["rows"], r["kernel"]) for r in record.data] == [(1, "torch"), (3, "torch")]
    assert all(r["ms"] > 0 for r in record.data) and record.floors["read_bandwidth_gbs"] > 0
    [table] = [b for b in record.body if b.kind.value == "table"]
    assert table.columns[:2] == ["rows", "torch ms (GB/s)"] and [r[0] for r in table.rows] == ["1", "3"]
    assert len(record.load_average.start) == len(record.load_average.end) == 1
