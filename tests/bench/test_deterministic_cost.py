"""bench/micro/deterministic_cost.py: a small real run prints one row per case,
default vs --deterministic, with the cost between them."""

from __future__ import annotations

import re

from bench.micro import deterministic_cost


def test_one_row_per_case_with_both_times_and_their_ratio(default_model_dir, capsys):
    deterministic_cost.main(["--batches", "1", "3", "--context", "8", "--steps", "1", "--rounds", "1",
                             "--prefill", "8"])
    rows = re.findall(r"^\s*(decode B=\d+|prefill T=\d+)\s+([\d.]+)\s+([\d.]+)\s+([+-]\d+)%$",
                      capsys.readouterr().out, re.MULTILINE)
    assert [r[0] for r in rows] == ["decode B=1", "decode B=3", "prefill T=8"]
    for _, off, on, _cost in rows:
        assert float(off) > 0 and float(on) > 0
