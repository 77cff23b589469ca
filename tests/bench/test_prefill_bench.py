"""bench/prefill_bench.py on a tiny random model: one row per chunk, both ways."""

from __future__ import annotations

from bench import prefill_bench


def test_one_row_per_chunk_with_the_prefix_each_saw(tiny_llama_dir, capsys):
    rows = prefill_bench.main(["--model-path", tiny_llama_dir, "--dtype", "float32", "--prompt", "70",
                               "--chunk", "32", "--no-write"])
    assert [(r["prefix"], r["tokens"]) for r in rows] == [(0, 32), (32, 32), (64, 6)]
    for r in rows:
        assert all(r[way] > 0 for way in prefill_bench.WAYS)
    out = capsys.readouterr().out
    assert "| 32 | 32 |" in out and "| all | 70 |" in out
