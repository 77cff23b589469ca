"""Our flat-token-axis model gives transformers' logits, step by step over the pool."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import RunnerDriver, hf_last_logits, load_hf, make_tiny_llama

ATOL = 1e-4
# Gemma's logits are larger (up to ~16 here: embeddings scaled by
# sqrt(hidden), two norms per block), and so their float32 rounding
GEMMA_ATOL = 3e-4
PROMPTS = [[5, 17, 99, 3, 250, 7, 8], [40, 41], [300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
# past the tiny models' window of 16 (tests/conftest.py), so sliding layers cut
LONG = [(i * 29) % 500 + 3 for i in range(40)]
FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"]


def assert_rows_match(hf, logits: torch.Tensor, seqs: list[list[int]], atol: float = ATOL) -> None:
    assert logits.dtype == torch.float32 and logits.shape[0] == len(seqs)
    for row_logits, seq in zip(logits, seqs):
        torch.testing.assert_close(row_logits, hf_last_logits(hf, seq), atol=atol, rtol=0)


def run_extend_then_decode(runner, hf, prompts: list[list[int]], steps: int = 4, atol: float = ATOL) -> None:
    driver = RunnerDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    seqs = [list(p) for p in prompts]
    logits = runner.compute_logits(driver.extend(rows, prompts))
    assert_rows_match(hf, logits, seqs, atol)
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = runner.compute_logits(driver.decode(rows, nxt))
        assert_rows_match(hf, logits, seqs, atol)


def atol_of(model: str) -> float:
    return GEMMA_ATOL if model.startswith("gemma") else ATOL


@pytest.mark.parametrize("model", FAMILIES)
def test_ragged_extend_then_decode_logits_equal_transformers(model, request, make_runner):
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    run_extend_then_decode(make_runner(folder), load_hf(folder), PROMPTS + [LONG], atol=atol_of(model))


@pytest.mark.parametrize("model", ["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_sliding_window_across_prefix_and_decode_equals_transformers(model, backend, request, make_runner):
    """A prompt prefilled in three pieces whose boundaries fall inside and
    past the window (16), then decoded past it: each sliding layer sees only
    its window, through the prefix in the pool and the new tokens."""
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    runner, hf = make_runner(folder, attention_backend=backend), load_hf(folder)
    atol = atol_of(model)
    driver = RunnerDriver(runner, seed=5)
    row, other = driver.new_row(), driver.new_row()
    pieces = [LONG[:10], LONG[10:31], LONG[31:]]
    seq: list[int] = []
    for i, piece in enumerate(pieces):
        seq += piece
        if i == 1:  # a fresh short row beside it
            logits = runner.compute_logits(driver.extend([row, other], [piece, PROMPTS[1]]))
            assert_rows_match(hf, logits, [seq, PROMPTS[1]], atol)
        else:
            assert_rows_match(hf, runner.compute_logits(driver.extend([row], [piece])), [seq], atol)
    short = list(PROMPTS[1])
    for step in range(20):  # the short row decodes past the window too
        seq.append(3 + step)
        short.append(7 + step)
        logits = runner.compute_logits(driver.decode([row, other], [seq[-1], short[-1]]))
        if step % 6 == 5:
            assert_rows_match(hf, logits, [seq, short], atol)


@pytest.mark.parametrize("model", FAMILIES)
def test_extend_on_top_of_a_prefix_in_the_pool_equals_transformers(model, request, make_runner):
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    runner, hf = make_runner(folder), load_hf(folder)
    driver = RunnerDriver(runner, seed=3)
    a, b = driver.new_row(), driver.new_row()
    atol = atol_of(model)
    first = PROMPTS[2][:5]
    assert_rows_match(hf, runner.compute_logits(driver.extend([a], [first])), [first], atol)
    # row a continues after its 5 pooled tokens; row b is fresh, in the same batch
    rest, fresh = PROMPTS[2][5:], PROMPTS[0]
    logits = runner.compute_logits(driver.extend([a, b], [rest, fresh]))
    assert_rows_match(hf, logits, [PROMPTS[2], fresh], atol)
    # and decoding goes on from both
    logits = runner.compute_logits(driver.decode([a, b], [33, 44]))
    assert_rows_match(hf, logits, [PROMPTS[2] + [33], fresh + [44]], atol)


def test_single_new_token_extend_with_prefix_equals_transformers(tiny_llama_dir, tiny_llama_hf, make_runner):
    runner = make_runner(tiny_llama_dir)
    driver = RunnerDriver(runner)
    row = driver.new_row()
    runner.compute_logits(driver.extend([row], [PROMPTS[0][:-1]]))
    logits = runner.compute_logits(driver.extend([row], [PROMPTS[0][-1:]]))
    assert_rows_match(tiny_llama_hf, logits, [PROMPTS[0]])


@pytest.mark.parametrize("overrides", [
    dict(attention_bias=True, mlp_bias=True),
    dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=32)),
    dict(head_dim=32, tie_word_embeddings=True),
], ids=["llama_biases", "llama3_rope_scaling", "wide_head_dim_tied"])
def test_llama_variants_equal_transformers(overrides, tmp_path, make_runner):
    folder = make_tiny_llama(str(tmp_path), seed=2, **overrides)
    long_prompt = [(i * 37) % 500 + 3 for i in range(90)]  # past the llama3 original context
    run_extend_then_decode(make_runner(folder), load_hf(folder), [long_prompt, PROMPTS[1]], steps=2)


def test_plain_torch_matmuls_equal_transformers_too(tiny_llama_dir, tiny_llama_hf, make_runner, monkeypatch):
    """The path without oneDNN packing (a GPU's, or a CPU without oneDNN):
    F.linear plus the epilogues as separate ops."""
    from model_proc.layers import Linear

    monkeypatch.setattr(Linear, "use_onednn", False)
    runner = make_runner(tiny_llama_dir)
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, Linear))
    run_extend_then_decode(runner, tiny_llama_hf, PROMPTS, steps=2)


def longrope(original_max: int) -> dict:
    """Phi-3 128k's rope scaling, shrunk: per-frequency short and long factors
    (head_dim 16: 8 each), the pretraining length at top level as Phi-3 writes it."""
    return dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                     short_factor=[1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0],
                                     long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]),
                original_max_position_embeddings=original_max)


@pytest.mark.parametrize("model_type, overrides", [
    ("phi3", longrope(128)),
    ("phi3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("qwen3", dict(attention_bias=True, head_dim=16)),
], ids=["phi3_longrope_within_original_max", "phi3_mha_tied", "qwen3_attention_bias"])
def test_qwen3_and_phi3_variants_equal_transformers(model_type, overrides, tmp_path, make_runner):
    folder = make_tiny_llama(str(tmp_path), model_type=model_type, seed=6, **overrides)
    long_prompt = [(i * 37) % 500 + 3 for i in range(90)]  # positions stay below 128
    run_extend_then_decode(make_runner(folder), load_hf(folder), [long_prompt, PROMPTS[1]], steps=2)


def test_longrope_positions_past_original_max_take_the_long_factors(tmp_path, make_runner):
    """Our rule past original_max_position_embeddings (docs/architecture.md):
    those positions' cos/sin are transformers' long-factor ones, the earlier
    positions keep the short-factor ones; the attention factor scales both."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    folder = make_tiny_llama(str(tmp_path), model_type="phi3", seed=6, **longrope(128))
    ours = make_runner(folder).model.rotary
    hf_rotary = load_hf(folder).model.rotary_emb
    assert isinstance(hf_rotary, Phi3RotaryEmbedding) and hf_rotary.attention_scaling > 1.0
    x = torch.zeros(1, dtype=torch.float32)
    for length in (100, 300):  # transformers: short factors for a sequence within 128, long ones past it
        cos, sin = hf_rotary(x, torch.arange(length)[None])
        span = slice(0, length) if length <= 128 else slice(128, length)
        torch.testing.assert_close(ours.cos[span], cos[0, span, :8], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.sin[span], sin[0, span, :8], atol=1e-6, rtol=0)
