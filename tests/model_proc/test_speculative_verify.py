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


@pytest.mark.parametrize("backend", ["native", "torch"])  # native: each token a decode row (as_token_rows)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 20, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_verify_keeps_exactly_the_decode_steps_tokens(tiny_llama_dir, make_runner, sampling, backend):
    runner = make_runner(tiny_llama_dir, attention_backend=backend)
    prompts = [PROMPT, [9, 8, 30, 31], list(range(20, 45))]
    ref = decode_run(runner, prompts, 14, **sampling)
    driver = RunnerDriver(make_runner(tiny_llama_dir, attention_backend=backend))
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


def test_verified_sampling_has_the_target_distribution():
    """Chi-square, seeded: a 4-token vocabulary whose next-token logits depend
    on the last token; 3 tokens per trial, drafted as a fixed guess (right
    sometimes, wrong sometimes), verified by the real sampler and
    accept_drafts, then sampled on one at a time after a rejection. The
    3-token sequences must follow the target's own distribution
    (temperature 0.7, top-k 3: the processed one)."""
    import itertools

    import torch

    from model_proc.sampler import Sampler, SamplingBatch

    V, n, temperature, top_k = 4, 20000, 0.7, 3
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 1.5  # logits after each token
    sampler = Sampler(random_seed=1)

    def sample(prev: torch.Tensor) -> torch.Tensor:
        rows = prev.numel()
        params = SamplingBatch.from_lists([temperature] * rows, [1.0] * rows, [top_k] * rows, [0.0] * rows,
                                          [-1] * rows, [0] * rows)
        return sampler(table[prev], params)

    first = int(table[0].argmax())
    drafts = torch.tensor([first, int(table[first].argmax())])  # the likeliest path after the start token 0
    inputs = torch.cat([torch.zeros(1, dtype=torch.int64), drafts])
    sampled = sample(inputs.repeat(n)).view(n, 3)  # each trial's verify: one sample after each input
    seqs = []
    flat_inputs = inputs.tolist() * n
    kept = accept_drafts(flat_inputs, [3] * n, sampled.view(-1).tolist())
    for row, k in zip(sampled.tolist(), kept):
        seqs.append(row[:k])
    while any(len(s) < 3 for s in seqs):  # after a rejection: one token at a time
        short = [s for s in seqs if len(s) < 3]
        for s, t in zip(short, sample(torch.tensor([s[-1] for s in short])).tolist()):
            s.append(t)

    probs = torch.softmax(table / temperature, dim=-1)
    probs[probs < probs.topk(top_k, dim=-1).values[:, -1:]] = 0.0
    probs /= probs.sum(-1, keepdim=True)
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    chi2, cells = 0.0, 0
    for seq in itertools.product(range(V), repeat=3):
        p = float(probs[0, seq[0]] * probs[seq[0], seq[1]] * probs[seq[1], seq[2]])
        if p == 0.0:
            assert seq not in counts, f"{seq} has probability 0 under the target"
            continue
        chi2 += (counts.get(seq, 0) - n * p) ** 2 / (n * p)
        cells += 1
    assert 0 < sum(k > 1 for k in kept) < n  # drafts were both kept and rejected
    # 27 cells of non-zero probability: 26 degrees of freedom, the 0.999 quantile is 54.05
    assert cells == 27 and chi2 < 54.05, chi2
