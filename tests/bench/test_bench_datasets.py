"""bench/lib/datasets.py: the traces' lengths, prompts and seeds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.lib.datasets import (CHAPTER_OUTPUT_LENS, GSP_SEPARATOR, chapter_lens, exponential_lens, next_history,
                            poisson_arrivals, sample_conversations, sample_rows, turn_prompt, uniform_lens)


class CharTokenizer:
    """One token per character ('a' + id), ids 0 and 1 special: enough for the traces."""

    vocab_size = 26
    eos_token_ids = [1]
    all_special_ids = [0, 1]

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if not (skip_special_tokens and i in (0, 1)))


def test_chapter_example_is_the_chapters_batch():
    lens = chapter_lens()
    assert len(lens) == 8 and sum(lens) == 1968 and max(lens) == 1024
    assert sum(lens) / (len(lens) * max(lens)) == pytest.approx(0.240, abs=5e-4)
    assert list(CHAPTER_OUTPUT_LENS) == lens


def test_chapter_example_scales_and_repeats():
    assert chapter_lens(0.125) == [2, 5, 8, 12, 19, 28, 44, 128]
    assert sum(chapter_lens(0.125)) / (8 * 128) == pytest.approx(0.240, abs=1e-3)
    assert min(chapter_lens(0.001)) == 1  # never a zero-length request
    assert chapter_lens(1.0, num=10)[8:] == chapter_lens(1.0)[:2]
    with pytest.raises(ValueError):
        chapter_lens(0)


def test_exponential_lengths_have_the_asked_mean():
    lens = exponential_lens(np.random.default_rng(0), 40000, 16.0)
    assert np.mean(lens) == pytest.approx(16.0, rel=0.02)
    assert min(lens) >= 1
    # exponential: the median is mean * ln 2
    assert np.median(lens) == pytest.approx(16.0 * math.log(2), rel=0.1)


def test_exponential_lengths_are_clipped_when_asked():
    lens = exponential_lens(np.random.default_rng(0), 5000, 50.0, max_len=60)
    assert max(lens) == 60 and min(lens) >= 1


def test_random_lengths_stay_in_the_range_ratio():
    lens = uniform_lens(np.random.default_rng(0), 2000, 100, 0.25)
    assert min(lens) >= 25 and max(lens) <= 100
    assert min(lens) <= 27 and max(lens) >= 98  # the whole range is used
    assert set(uniform_lens(np.random.default_rng(0), 50, 7, 1.0)) == {7}
    with pytest.raises(ValueError):
        uniform_lens(np.random.default_rng(0), 5, 10, 1.5)


def test_same_seed_same_trace_other_seed_other_trace():
    tok = CharTokenizer()
    kw = dict(num=20, input_len=12, output_len=9, range_ratio=0.5)
    for name in ("random", "random-ids", "exponential"):
        a = sample_rows(name, tok, seed=3, **kw)
        assert a == sample_rows(name, tok, seed=3, **kw)
        assert a != sample_rows(name, tok, seed=4, **kw)


def test_random_ids_rows_are_exact_and_avoid_special_tokens():
    rows = sample_rows("random-ids", CharTokenizer(), num=50, seed=0, input_len=30, output_len=5,
                       range_ratio=1.0)
    for r in rows:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 30
        assert not {0, 1} & set(r.prompt)
        assert r.output_len == 5


def test_text_rows_record_the_retokenised_prompt_length():
    rows = sample_rows("random", CharTokenizer(), num=5, seed=0, input_len=10, output_len=3, range_ratio=1.0)
    for r in rows:
        assert isinstance(r.prompt, str) and r.prompt_len == len(r.prompt) == 10


def test_chapter_example_rows_use_fixed_prompts_and_the_chapters_outputs():
    rows = sample_rows("chapter-example", CharTokenizer(), num=8, seed=0, input_len=6, output_len=999,
                       chapter_scale=0.25)
    assert [r.output_len for r in rows] == chapter_lens(0.25)
    assert {r.prompt_len for r in rows} == {6}


def test_poisson_arrivals():
    assert poisson_arrivals(np.random.default_rng(0), 5, float("inf")) == [0.0] * 5
    t = poisson_arrivals(np.random.default_rng(0), 20000, 4.0)
    assert t == sorted(t)
    assert np.mean(np.diff(t)) == pytest.approx(0.25, rel=0.03)


def test_sharegpt_reads_a_local_file_and_needs_one(tmp_path):
    path = tmp_path / "sharegpt.json"
    convs = [{"conversations": [{"from": "human", "value": "abcdefgh" * (k + 1)},
                                {"from": "gpt", "value": "xyzw" * (k + 1)}]} for k in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "ab"}, {"from": "gpt", "value": "cdefg"}]})
    path.write_text(json.dumps(convs))
    rows = sample_rows("sharegpt", CharTokenizer(), num=6, seed=0, input_len=0, output_len=0,
                       dataset_path=str(path))
    assert sorted(r.output_len for r in rows) == [4, 8, 12, 16, 20, 24]  # the 2-token prompt is dropped
    with pytest.raises(ValueError, match="dataset-path"):
        sample_rows("sharegpt", CharTokenizer(), num=1, seed=0, input_len=1, output_len=1)


GSP = dict(num_groups=4, prompts_per_group=5, system_prompt_len=40, question_len=7, output_len=9)


def test_shared_prefix_prompts_of_a_group_share_exactly_its_system_prompt():
    rows = sample_rows("generated-shared-prefix", CharTokenizer(), num=0, seed=2, input_len=0, output_len=0, gsp=GSP)
    assert len(rows) == 4 * 5  # groups x prompts per group; --num-prompts plays no part, as in SGLang
    assert sorted(r.group for r in rows) == sorted(list(range(4)) * 5)
    assert [r.group for r in rows] != sorted(r.group for r in rows)  # shuffled: groups do not come in runs
    systems = {}
    for r in rows:
        system, question = r.prompt.split(GSP_SEPARATOR)
        assert systems.setdefault(r.group, system) == system  # one system prompt per group
        assert len(system) == r.prefix_len == 40 and len(question) == 7
        assert r.prompt_len == len(r.prompt) == 40 + len(GSP_SEPARATOR) + 7 and r.output_len == 9
    assert len(set(systems.values())) == 4  # and no two groups share theirs
    questions = [r.prompt.split(GSP_SEPARATOR)[1] for r in rows]
    assert len(set(questions)) == len(questions)
    assert not set("ab") & set("".join(systems.values()) + "".join(questions))  # no special ids


def test_shared_prefix_trace_is_seeded():
    tok = CharTokenizer()
    a = sample_rows("generated-shared-prefix", tok, num=0, seed=5, input_len=0, output_len=0, gsp=GSP)
    assert a == sample_rows("generated-shared-prefix", tok, num=0, seed=5, input_len=0, output_len=0, gsp=GSP)
    assert a != sample_rows("generated-shared-prefix", tok, num=0, seed=6, input_len=0, output_len=0, gsp=GSP)
    with pytest.raises(ValueError):
        sample_rows("generated-shared-prefix", tok, num=0, seed=5, input_len=0, output_len=0,
                    gsp={**GSP, "question_len": 0})


def test_conversations_are_seeded_questions_of_the_asked_length():
    tok = CharTokenizer()
    convs = sample_conversations(tok, num=3, turns=4, question_len=6, output_len=5, seed=1)
    assert convs == sample_conversations(tok, num=3, turns=4, question_len=6, output_len=5, seed=1)
    assert convs != sample_conversations(tok, num=3, turns=4, question_len=6, output_len=5, seed=2)
    assert len(convs) == 3
    for c in convs:
        assert len(c.questions) == 4 and c.question_lens == (6, 6, 6, 6) and c.output_len == 5
        assert all(len(q) == 6 for q in c.questions)
    with pytest.raises(ValueError, match="sample_conversations"):
        sample_rows("multi-turn", tok, num=1, seed=0, input_len=1, output_len=1)


def test_every_turn_begins_with_the_previous_prompt_and_its_answer():
    first = turn_prompt("", "hello")
    history = next_history(first, "an answer")
    second = turn_prompt(history, "again")
    assert first.endswith("hello<|im_end|>\n<|im_start|>assistant\n")
    assert second.startswith(first + "an answer")
    assert second.endswith("again<|im_end|>\n<|im_start|>assistant\n")
