"""bench/micro/penalty_cost.py: a small real run on the tiny model gives one row per
batch size, with the three cases timed and the penalty work alone."""

from __future__ import annotations

from bench.micro import penalty_cost


def test_one_row_per_batch_with_every_case_timed(tiny_llama_dir, capsys):
    rows = penalty_cost.main(["--model-path", tiny_llama_dir, "--dtype", "float32", "--batches", "1", "3",
                              "--context", "16", "--steps", "2", "--rounds", "1"])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert all(r[f"{c}_ms"] > 0 for c in penalty_cost.CASES)
        assert r["penalties_none_ms"] == 0 and r["penalties_one_ms"] > 0 and r["penalties_all_ms"] > 0
    out = capsys.readouterr().out
    assert "none ms" in out and "penalties ms" in out
