"""Penalties on the model side: each formula against a direct reference
computation, the per-row state built from what the scheduler sends and
advanced by the sampled tokens, and rows without penalties untouched."""

from __future__ import annotations

import torch

from common.messages import ForwardBatch, ForwardMode, PenaltyInit
from model_proc.penalties import PenaltyState, apply_penalties, penalty_terms
from tests.helpers import RunnerDriver

V = 64


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def penalize(logits: torch.Tensor, prompt: list[list[int]], output: list[list[int]], frequency=0.0,
             presence=0.0, repetition=1.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    n = logits.shape[0]
    counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=V) for o in output])
    seen = torch.zeros(n, V, dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompt, output)):
        seen[i, p + o] = True
    scale, additive = penalty_terms(counts, seen, torch.full((n,), frequency), torch.full((n,), presence),
                                    torch.full((n,), repetition), torch.zeros(n, V) if bias is None else bias)
    return apply_penalties(logits.clone(), scale, additive)


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = random_logits(4)
    prompts = [[1, 2, 3], [5, 5, 9], [0], [60, 61, 62, 63]]
    outputs = [[4, 1], [7], [0, 0, 2], [10]]
    for penalty in (1.3, 0.7, 2.0):
        ours = penalize(logits, prompts, outputs, repetition=penalty)
        ids = torch.tensor([p + o + [p[0]] * (6 - len(p + o)) for p, o in zip(prompts, outputs)])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        assert torch.equal(ours, ref), penalty


def test_frequency_and_presence_follow_openai_formula():
    logits = random_logits(3, seed=1)
    outputs = [[3, 3, 3, 8], [], [8, 9, 9]]
    prompts = [[3, 4], [8], [1]]  # the prompt does not count for these two
    ours = penalize(logits, prompts, outputs, frequency=0.5, presence=-1.25)
    ref = logits.clone()
    for i, out in enumerate(outputs):
        for j in set(out):
            c = out.count(j)
            ref[i, j] = logits[i, j] - c * 0.5 - float(c > 0) * -1.25
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6)
    assert torch.equal(ours[1], logits[1])  # nothing generated yet: nothing changes


def test_logit_bias_adds_to_the_logit():
    logits = random_logits(2, seed=2)
    bias = torch.zeros(2, V)
    bias[0, 5], bias[1, 7], bias[1, 0] = 100.0, -100.0, 2.5
    ours = penalize(logits, [[1], [1]], [[], []], bias=bias)
    ref = logits.clone()
    ref[0, 5] += 100.0
    ref[1, 7] -= 100.0
    ref[1, 0] += 2.5
    assert torch.equal(ours, ref)


def test_neutral_parameters_leave_logits_bit_identical():
    logits = random_logits(4, seed=3)
    assert torch.equal(penalize(logits, [[1, 2]] * 4, [[2, 3, 3]] * 4), logits)


def _batch(rows: list[int], steps: list[int], penalty_rows: list[int],
           inits: list[PenaltyInit] | None = None) -> ForwardBatch:
    n = len(rows)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, req_pool_indices=rows, seq_lens=[10] * n, prefix_lens=[],
                        input_ids=[1] * n, out_cache_loc=[1] * n, temperatures=[0.0] * n, top_ps=[1.0] * n,
                        top_ks=[-1] * n, min_ps=[0.0] * n, seeds=[-1] * n, sample_steps=steps,
                        penalty_rows=penalty_rows, penalty_inits=inits or [])


def _init(row: int, **kw) -> PenaltyInit:
    args = dict(output_ids=[], prompt_ids=[], frequency_penalty=0.0, presence_penalty=0.0,
                repetition_penalty=1.0, min_new_tokens=0, stop_ids=[], logit_bias={})
    args.update(kw)
    return PenaltyInit(row=row, **args)


def test_state_is_built_from_the_init_and_counts_each_sampled_token():
    state = PenaltyState(num_rows=5, vocab_size=V, device=torch.device("cpu"))
    assert not state.allocated and state.nbytes == 0
    # row 3 (batch position 1) comes back after a retraction with 3 tokens generated
    init = _init(1, output_ids=[7, 7, 9], prompt_ids=[1, 2], frequency_penalty=1.0, presence_penalty=0.3,
                 repetition_penalty=1.5, logit_bias={9: 0.7, 12: -2.0})
    batch = _batch([2, 3], [0, 3], [1], [init])
    state.init_rows(batch)
    assert state.counts[3, 7] == 2 and state.counts[3, 9] == 1 and int(state.counts[3].sum()) == 3
    assert (state.scale[3] != 1).nonzero().flatten().tolist() == [1, 2, 7, 9]  # the tokens seen
    logits = random_logits(2, seed=4)
    before = logits.clone()
    state.apply(logits, batch)
    assert torch.equal(logits[0], before[0])  # row 2 has no penalties: untouched
    bias = torch.zeros(1, V)
    bias[0, 9], bias[0, 12] = 0.7, -2.0
    assert torch.equal(logits[1:], penalize(before[1:], [[1, 2]], [[7, 7, 9]], frequency=1.0, presence=0.3,
                                            repetition=1.5, bias=bias))
    # each sampled token updates the terms in place, bit for bit as recomputing them would
    output = [7, 7, 9]
    for token in (5, 9, 5, 33):
        state.update(batch, torch.tensor([0, token]))
        output.append(token)
        logits = before.clone()
        state.apply(logits, batch)
        assert torch.equal(logits[1:], penalize(before[1:], [[1, 2]], [output], frequency=1.0, presence=0.3,
                                                repetition=1.5, bias=bias))
    assert state.counts[3, 5] == 2 and state.counts[2].sum() == 0  # row 2 is not counted
    # a new request in row 3 starts from its own init, nothing of the old one left
    state.init_rows(_batch([3], [0], [0], [_init(0, logit_bias={4: 1.0})]))
    assert state.counts[3].sum() == 0 and (state.scale[3] == 1).all() and state.frequency[3] == 0
    assert state.additive[3].nonzero().flatten().tolist() == [4]


def test_min_new_tokens_masks_stop_ids_until_reached():
    state = PenaltyState(num_rows=3, vocab_size=V, device=torch.device("cpu"))
    init = _init(0, min_new_tokens=2, stop_ids=[2, 11, 10**6])  # an id beyond the vocabulary is ignored
    for step, masked in ((0, True), (1, True), (2, False)):
        logits = random_logits(1, seed=step)
        before = logits.clone()
        batch = _batch([1], [step], [0], [init])
        state.init_rows(batch)
        state.apply(logits, batch)
        if masked:
            assert logits[0, 2] == logits[0, 11] == float("-inf")
            keep = torch.ones(V, dtype=torch.bool)
            keep[[2, 11]] = False
            assert torch.equal(logits[0, keep], before[0, keep])
        else:
            assert torch.equal(logits, before)


def _capture_logits(runner) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    sampler = runner.sampler

    def capture(logits, params):
        seen.append(logits.clone())
        return sampler(logits, params)
    runner.sampler = capture
    return seen


PROMPTS = [[1, 45, 300, 12, 7, 99, 101], [9, 8, 7, 300, 300]]


def _run(runner, inits: list[PenaltyInit], penalty_rows: list[int], steps: int = 4) -> list[torch.Tensor]:
    """Prefill both prompts, then decode; the penalized rows listed every step."""
    logits = _capture_logits(runner)
    driver = RunnerDriver(runner)
    rows = [driver.new_row(), driver.new_row()]
    batch = driver.extend(rows, PROMPTS)
    batch.penalty_rows, batch.penalty_inits = penalty_rows, inits
    out = [driver.step(batch)]
    for _ in range(steps - 1):
        batch = driver.decode(rows, out[-1])
        batch.penalty_rows = penalty_rows
        out.append(driver.step(batch))
    return logits


def test_runner_penalizes_only_its_rows_and_other_rows_are_bit_identical(tiny_llama_dir, make_runner):
    plain = _run(make_runner(tiny_llama_dir), [], [])
    init = _init(0, prompt_ids=PROMPTS[0], frequency_penalty=0.7, presence_penalty=0.4,
                 repetition_penalty=1.3, logit_bias={17: 3.0})
    penal = _run(make_runner(tiny_llama_dir), [init], [0])
    # step 0: same forward, so row 1 is bit-identical and row 0 is the reference applied to it
    assert torch.equal(penal[0][1], plain[0][1])
    v = plain[0].shape[1]
    bias = torch.zeros(1, v)
    bias[0, 17] = 3.0
    seen = torch.zeros(1, v, dtype=torch.bool)
    seen[0, PROMPTS[0]] = True
    scale, additive = penalty_terms(torch.zeros(1, v, dtype=torch.int32), seen, torch.tensor([0.7]),
                                    torch.tensor([0.4]), torch.tensor([1.3]), bias)
    assert torch.equal(penal[0][:1], apply_penalties(plain[0][:1].clone(), scale, additive))
    # later steps: row 1 never changes (its own tokens are the same greedy ones)
    for a, b in zip(plain, penal):
        assert torch.equal(a[1], b[1])
