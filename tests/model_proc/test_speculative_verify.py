"""ModelRunner's verify step (ForwardMode.VERIFY): every new token is sampled,
and a row keeps its drafts up to the first its samples disagree with, plus
that sample. Kept tokens equal what one-token decode steps would produce."""

from __future__ import annotations

import pytest

from model_proc.sampler import accept_drafts
from tests.helpers import RunnerDriver

PROMPT = [1, 45, 300, 12, 7, 99, 101]


def decode_run(runner, prompts: list[list[int]], steps: int, **sampling) -> list[list[int]]:
    """Each prompt's tokens from one-token decode steps (the reference)."""
    driver = RunnerDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    out = [[t] for t in driver.step(driver.extend(rows, prompts, **sampling))]
    for _ in range(steps - 1):
        for o, t in zip(out, driver.step(driver.decode(rows, [o[-1] for o in out], **sampling))):
            o.append(t)
    return out


def test_accept_drafts_keeps_agreeing_drafts_and_the_sample_after_them():
    # row 0: last token 5, drafts 6 7 8; samples agree on 6 and 7, not 8
    # row 1: no drafts; row 2: the first draft is wrong
    inputs = [5, 6, 7, 8, 9, 3, 4]
    sampled = [6, 7, 1, 2, 10, 0, 4]
    assert accept_drafts(inputs, [4, 1, 2], sampled) == [3, 1, 1]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 20, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_verify_keeps_exactly_the_decode_steps_tokens(tiny_llama_dir, make_runner, sampling):
    runner = make_runner(tiny_llama_dir)
    prompts = [PROMPT, [9, 8, 30, 31], list(range(20, 45))]
    ref = decode_run(runner, prompts, 14, **sampling)
    driver = RunnerDriver(make_runner(tiny_llama_dir))
    rows = [driver.new_row() for _ in prompts]
    out = [[t] for t in driver.step(driver.extend(rows, prompts, **sampling))]
    # drafts: the reference's next tokens, one of them wrong for row 0 (at 2),
    # all right for row 1, none for row 2
    drafts = [ref[0][1:5], ref[1][1:6], []]
    drafts[0][2] = (drafts[0][2] + 1) % 512
    kept = driver.step_verify(driver.verify(rows, [o[-1] for o in out], drafts, **sampling))
    assert [len(k) for k in kept] == [3, 6, 1]
    for o, k in zip(out, kept):
        o.extend(k)
    # then more verifies, with a wrong first draft, and decode steps after them
    kept = driver.step_verify(driver.verify(rows, [o[-1] for o in out], [[0, 1], [], [2]], **sampling))
    for o, k in zip(out, kept):
        o.extend(k)
    while min(len(o) for o in out) < 14:
        for o, t in zip(out, driver.step(driver.decode(rows, [o[-1] for o in out], **sampling))):
            o.append(t)
    assert [o[:14] for o in out] == ref
