"""bench/micro/prefill_bench.py on a tiny random model: both targets, both ways, in one run."""

from __future__ import annotations

import pytest

from bench.micro import prefill_bench
from tests.helpers import make_tiny_llama


def test_whole_chunked_and_each_prefix_are_timed_both_ways(tiny_llama_dir, capsys):
    result = prefill_bench.main(["--model-path", tiny_llama_dir, "--dtype", "float32", "--prompt", "70",
                                 "--chunk", "32", "--prefixes", "16", "38", "60", "--repeats", "1",
                                 "--before", "--no-write"])
    assert result["whole"] > 0
    assert set(result["chunked"]) == set(result["extend"]) == {"now", "before"}
    # 60 cached tokens leave no room for a 32-token extend in a 70-token context
    assert list(result["extend"]["now"]) == [0, 16, 38]
    assert result["floor"][38] > result["floor"][16] > result["floor"][0] > 0
    out = capsys.readouterr().out
    assert "| 38 |" in out and "ratio (before)" in out and "Targets (now):" in out


def test_chunks_follow_one_another_on_the_prefix_the_earlier_ones_left():
    batches = prefill_bench.chunk_batches(list(range(3, 73)), 32)
    assert [(b.prefix_lens[0], len(b.input_ids)) for b in batches] == [(0, 32), (32, 32), (64, 6)]
    assert batches[2].out_cache_loc == list(range(65, 71))


def test_the_other_extend_path_is_timed_beside_the_default(tmp_path, capsys):
    """bfloat16 on the matrix units: the op's extend is the default ("now");
    the torch path's is timed beside it."""
    from model_proc import native

    op = native.load()
    if op is None or not op.extend_on_matrix_units("bfloat16", 32):
        pytest.skip("no native bfloat16 extend on this CPU (needs AMX or AVX512_BF16 and a compiler)")
    folder = make_tiny_llama(str(tmp_path / "d32"), hidden_size=128)  # head_dim 32: the op's brgemm extend
    result = prefill_bench.main(["--model-path", folder, "--dtype", "bfloat16", "--prompt", "96",
                                 "--chunk", "32", "--prefixes", "32", "--repeats", "1", "--no-write"])
    assert set(result["chunked"]) == set(result["extend"]) == {"now", "torch"}
    out = capsys.readouterr().out
    assert "native (its extend: the op's) backend" in out and "ratio (torch)" in out
