"""ModelRunner on a tiny model: greedy decoding through forward() equals transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import RunnerDriver, hf_greedy

PROMPT = [1, 45, 300, 12, 7, 99, 101]


def test_runner_greedy_equals_transformers_generate(tiny_llama_dir, tiny_llama_hf, make_runner):
    ours = RunnerDriver(make_runner(tiny_llama_dir)).greedy([PROMPT], max_new_tokens=12)[0]
    assert ours == hf_greedy(tiny_llama_hf, PROMPT, 12)


def test_batched_ragged_rows_each_equal_their_own_generate(tiny_qwen2_dir, make_runner):
    from tests.helpers import load_hf

    hf = load_hf(tiny_qwen2_dir)
    prompts = [PROMPT, [9, 8], list(range(20, 45))]
    ours = RunnerDriver(make_runner(tiny_qwen2_dir)).greedy(prompts, max_new_tokens=8)
    assert ours == [hf_greedy(hf, p, 8) for p in prompts]


def test_seeded_sampling_through_forward_ignores_batch_mates(tiny_llama_dir, make_runner):
    runner = make_runner(tiny_llama_dir)
    driver = RunnerDriver(runner)
    a = driver.new_row()
    alone = driver.step(driver.extend([a], [PROMPT], temperature=1.0, seed=11))
    b, c = driver.new_row(), driver.new_row()
    batch = driver.extend([b, c], [[5, 6, 7], PROMPT], temperature=1.0, seed=11)
    batch.seeds[0] = -1  # a neighbour without a seed
    assert driver.step(batch)[1] == alone[0]


def test_model_info(tiny_llama_dir, make_runner, tmp_path):
    info = make_runner(tiny_llama_dir, max_total_tokens=300, context_length=256).model_info
    assert info.model_path == info.tokenizer_path == tiny_llama_dir
    assert info.served_model_name == os.path.basename(tiny_llama_dir)
    assert (info.context_len, info.max_total_tokens, info.vocab_size) == (256, 300, 512)
    assert info.eos_token_ids == [2]
    # 2 layers x (K + V) x 2 kv heads x head_dim 16 x 4 bytes x (300 + dummy slot)
    assert info.kv_cache_bytes == 2 * 2 * 2 * 16 * 4 * 301
    assert (info.dtype, info.device) == ("float32", "cpu")


def test_eos_ids_merge_config_and_generation_config(tiny_llama_dir, make_runner, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(tiny_llama_dir):
        os.symlink(os.path.join(tiny_llama_dir, name), folder / name)
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    runner = make_runner(str(folder), served_model_name="tiny", tokenizer_path="/tok")
    assert runner.model_info.eos_token_ids == [2, 7]
    assert (runner.model_info.served_model_name, runner.model_info.tokenizer_path) == ("tiny", "/tok")


@pytest.mark.parametrize("break_it", [
    lambda b: b.input_ids.pop(),
    lambda b: b.seq_lens.__setitem__(0, 10_000),
    lambda b: b.out_cache_loc.__setitem__(0, 10_000),
    lambda b: b.prefix_lens.__setitem__(0, b.seq_lens[0]),
    lambda b: b.req_pool_indices.__setitem__(0, 0),
    lambda b: b.temperatures.pop(),
    lambda b: setattr(b, "forward_mode", "bogus"),
], ids=["ids", "seq_len", "slot", "prefix", "row", "sampling", "mode"])
def test_malformed_batches_are_rejected(break_it, tiny_llama_dir, make_runner):
    driver = RunnerDriver(make_runner(tiny_llama_dir))
    batch = driver.extend([driver.new_row()], [PROMPT])
    break_it(batch)
    with pytest.raises(ValueError):
        driver.runner.forward(batch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runner_stays_close_to_float32(dtype, tiny_llama_dir, make_runner):
    logits = {}
    for dt in ("float32", dtype):
        runner = make_runner(tiny_llama_dir, dtype=dt)
        driver = RunnerDriver(runner)
        logits[dt] = runner.compute_logits(driver.extend([driver.new_row()], [PROMPT]))
    assert runner.kv_pool.k_buffer[0].dtype == getattr(torch, dtype)
    assert logits[dtype].dtype == torch.float32
    assert (logits[dtype] - logits["float32"]).abs().max() < 0.25 * logits["float32"].std()


def test_cuda_device_without_cuda_is_a_clear_error(tiny_llama_dir, make_runner, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        make_runner(tiny_llama_dir, device="cuda", attention_backend="torch")


def test_a_row_given_another_rows_prefix_by_the_scheduler_attends_to_those_slots(tiny_llama_dir, make_runner):
    """table_rows/table_lens/table_slots: a request starting from KV another
    one computed (a prefix-cache hit) extends only its own tail, and its
    logits equal those of prefilling its whole prompt."""
    import msgspec

    runner = make_runner(tiny_llama_dir)
    driver = RunnerDriver(runner)
    a, b, c = driver.new_row(), driver.new_row(), driver.new_row()
    whole = runner.compute_logits(driver.extend([a], [PROMPT]))[0]
    runner.compute_logits(driver.extend([b], [PROMPT[:5]]))
    shared = runner.req_to_token.table[b, :5].tolist()
    driver.seq_lens[c] = 5  # c's first 5 tokens are b's slots, which the scheduler hands to c
    tail = msgspec.structs.replace(driver.extend([c], [PROMPT[5:]]), table_rows=[c], table_lens=[5],
                                   table_slots=shared)
    torch.testing.assert_close(runner.compute_logits(tail)[0], whole, atol=1e-5, rtol=1e-5)
    assert runner.req_to_token.table[c, :5].tolist() == shared
