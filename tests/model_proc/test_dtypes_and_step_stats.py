"""dtype resolution ("auto") and the model process's decode-step log line."""

from __future__ import annotations

import logging

import pytest
import torch

from common.messages import ForwardMode
from model_proc.dtypes import dtype_name, native_bfloat16, resolve_dtype
from model_proc.step_stats import DecodeStepStats

CPU = torch.device("cpu")


def test_explicit_dtypes_are_used_as_given():
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert dtype_name(resolve_dtype("float16", CPU)) == "float16"
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("int8", CPU)


def test_auto_is_bfloat16_only_with_native_support():
    expected = torch.bfloat16 if native_bfloat16(CPU) else torch.float32
    assert resolve_dtype("auto", CPU) == expected


def test_step_stats_count_only_decode_after_decode(caplog):
    stats = DecodeStepStats(interval=3)
    caplog.set_level(logging.DEBUG, logger="model_proc.step_stats")
    # an extend, then decode steps of 4 rows: 10 ms forward, starting 12 ms apart
    stats.record(ForwardMode.EXTEND, 4, start=0.0, forward_s=0.5)
    t = 1.0
    for _ in range(4):
        stats.record(ForwardMode.DECODE, 4, start=t, forward_s=0.010)
        t += 0.012
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("Model decode steps: 3, #rows: 4-4, forward ms/step: 10.00, step ms: 12.00")
    assert lines[0].endswith("outside forward: 16.7%")
    # an extend in between breaks the chain: its gap never counts as overhead
    stats.record(ForwardMode.EXTEND, 1, start=50.0, forward_s=0.1)
    stats.record(ForwardMode.DECODE, 5, start=60.0, forward_s=0.01)
    assert stats.steps == 0


def test_server_args_accept_auto_and_refuse_unknown_dtypes():
    from common.server_args import ServerArgs

    assert ServerArgs(model_path="m", dtype="auto").dtype == "auto"
    assert ServerArgs.from_cli(["--model-path", "m", "--dtype", "auto"]).dtype == "auto"
    with pytest.raises(ValueError, match="--dtype"):
        ServerArgs(model_path="m", dtype="float64")
