"""Sampler: greedy is argmax, filters hold, seeded rows are reproducible."""

from __future__ import annotations

import pytest
import torch

from model_proc.sampler import Sampler, SamplingBatch

V = 64


def params(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
           seeds: list[int] | None = None, steps: list[int] | None = None, **per_row) -> SamplingBatch:
    lists = dict(temperatures=[temperature] * n, top_ps=[top_p] * n, top_ks=[top_k] * n,
                 min_ps=[min_p] * n, seeds=seeds or [-1] * n, steps=steps or [0] * n)
    lists.update(per_row)
    return SamplingBatch.from_lists(**lists)


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_are_exactly_argmax():
    logits = random_logits(32)
    assert torch.equal(Sampler(0)(logits, params(32, temperature=0.0)), logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_batch_with_sampled_rows():
    logits = random_logits(8)
    temps = [0.0, 1.0] * 4
    out = Sampler(0)(logits, params(8, temperatures=temps))
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_top_k_1_equals_greedy():
    logits = random_logits(32, seed=1)
    out = Sampler(123)(logits, params(32, temperature=1.5, top_k=1))
    assert torch.equal(out, logits.argmax(-1))


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    logits = random_logits(1, seed=2).repeat(6, 1)
    alone = Sampler(0)(logits[:1], params(1, seeds=[42], steps=[5]))
    # same row in another position, among other seeded and unseeded rows, another process seed
    mixed = Sampler(99)(logits, params(6, seeds=[-1, 7, 42, -1, 8, 42], steps=[0, 5, 5, 3, 1, 6]))
    assert mixed[2] == alone[0]
    again = Sampler(5)(logits[:1], params(1, seeds=[42], steps=[5]))
    assert again[0] == alone[0]


def test_seeded_draws_vary_with_step_and_seed():
    logits = torch.zeros(1, V)  # uniform: any token equally likely
    by_step = {Sampler(0)(logits, params(1, seeds=[1], steps=[s])).item() for s in range(40)}
    by_seed = {Sampler(0)(logits, params(1, seeds=[s], steps=[0])).item() for s in range(40)}
    assert len(by_step) > 10 and len(by_seed) > 10


def test_unseeded_rows_follow_the_process_seed():
    logits = torch.zeros(16, V)
    a, b = Sampler(3)(logits, params(16)), Sampler(3)(logits, params(16))
    assert torch.equal(a, b)
    assert not torch.equal(a, Sampler(4)(logits, params(16)))


def sample_many(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    return Sampler(0)(logits_row.repeat(n, 1), params(n, **kw))


def test_top_k_never_picks_outside_the_k_best():
    row = random_logits(1, seed=4)[0]
    out = sample_many(row, 4000, temperature=2.0, top_k=5)
    allowed = set(row.topk(5).indices.tolist())
    assert set(out.tolist()) == allowed  # all of them show up, nothing else does


def test_top_p_never_picks_outside_the_nucleus():
    row = random_logits(1, seed=5)[0]
    probs = row.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    # the smallest prefix of the sorted tokens whose mass reaches top_p
    size = int((sorted_p.cumsum(0) < 0.7).sum()) + 1
    allowed = set(order[:size].tolist())
    out = sample_many(row, 4000, top_p=0.7)
    assert set(out.tolist()) == allowed


def test_top_k_and_top_p_together_take_the_smaller_set():
    row = torch.tensor([4.0, 3.9, 3.8, 3.7, 0.0, 0.0] + [-5.0] * (V - 6))
    assert set(sample_many(row, 2000, top_k=3, top_p=0.99).tolist()) == {0, 1, 2}
    assert set(sample_many(row, 2000, top_k=10, top_p=0.3).tolist()) == {0, 1}


def test_min_p_drops_tokens_below_the_floor():
    row = random_logits(1, seed=6)[0] / 3
    probs = row.softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())
    assert len(allowed) > 2
    assert set(sample_many(row, 4000, min_p=0.2).tolist()) == allowed


def test_sampled_frequencies_follow_the_tempered_distribution():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    n = 20000
    counts = torch.bincount(sample_many(row, n, temperature=2.0), minlength=V).float()
    expected = (row / 2.0).softmax(-1) * n
    assert counts[4:].sum() == 0
    # within ~5 standard deviations of the binomial counts
    assert ((counts[:4] - expected[:4]).abs() < 5 * expected[:4].sqrt() + 1).all()


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    import torch as _t

    from model_proc.sampler import Sampler, SamplingBatch

    logits = _t.tensor([[0.0, 3.0, 1.0, -2.0]])
    params = SamplingBatch.from_lists([0.7], [5e-324], [-1], [0.0], [7], [0])
    assert Sampler(0)(logits, params).tolist() == [1]


def test_token_bitmask_masks_exactly_the_clear_bits_of_the_listed_rows():
    from model_proc.sampler import apply_token_bitmask

    g = torch.Generator().manual_seed(0)
    vocab, batch, rows = 100, 5, [3, 0]
    logits = torch.randn(batch, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    out = logits.clone()
    apply_token_bitmask(out, rows, words.numpy().tobytes())
    for j, r in enumerate(rows):
        allowed = [(int(words[j, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        for t in range(vocab):
            assert out[r, t] == (logits[r, t] if allowed[t] else float("-inf"))
    for r in set(range(batch)) - set(rows):
        assert torch.equal(out[r], logits[r])  # rows without a grammar are untouched


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_first_argmax_equals_argmax_on_ties_and_nan(native, monkeypatch):
    from model_proc import layers
    from model_proc.sampler import first_argmax

    monkeypatch.setattr(layers, "use_native", native)
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        x = torch.randint(0, 4, (16, 4099), generator=gen).float()  # many ties per row
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    x = torch.randn(3, 1000, generator=gen)
    x[1, 7] = x[1, 9] = float("nan")
    x[2] = -float("inf")
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    x = torch.randn(5, 49152, generator=gen)  # the default model's vocabulary
    x[4, -1] = 100.0  # in the last vector
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
