"""The prefix cache with the real model (tiny, random weights, float32): greedy
outputs with the cache equal those without it, while requests share system
prompts and earlier turns, prompts are prefilled in chunks, the pool is small
enough to evict and retract, and the overlap schedule is on or off. Batch
shapes differ between the runs (a cached prefix is not recomputed), so the
comparison uses the near-tie criterion (tests/helpers.greedy_parting)."""

from __future__ import annotations

import random

import pytest

from tests.helpers import greedy_parting
from tests.scheduler.test_engine_matches_transformers import Engine
from tokenizer_proc.finish_json import finish_json


def shared_prefix_load(seed: int) -> dict[int, list[tuple[str, list[int], int]]]:
    """Arrivals over 30 steps: two system prompts, each followed by questions,
    and follow-ups that extend an earlier prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 512) for _ in range(n)] for n in (48, 30)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    prompts: list[list[int]] = []
    for i in range(16):
        base = rng.choice(systems) if i < 4 or rng.random() < 0.6 else rng.choice(prompts)
        prompt = base + [rng.randrange(3, 512) for _ in range(rng.randint(2, 12))]
        prompts.append(prompt)
        arrivals.setdefault(rng.randint(0, 30), []).append((f"r{i}", prompt, rng.randint(4, 16)))
    return arrivals


def run(model_dir: str, arrivals, **args) -> Engine:
    engine = Engine(model_dir, ignore_eos=False, max_running_requests=6, **args)
    engine.run(arrivals)
    engine.assert_no_leak()
    return engine


@pytest.mark.parametrize("mixed", [False, True], ids=["unmixed", "mixed-chunk"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_greedy_outputs_with_the_cache_equal_those_without(tiny_llama_dir, overlap, mixed):
    """With --enable-mixed-chunk too: the running rows' decode slots are taken
    in the same step as prefills whose tokens the tree may already hold. The
    cache runs on pages of 4 tokens (it shares whole pages only)."""
    arrivals = shared_prefix_load(0)
    ref = run(tiny_llama_dir, arrivals, disable_radix_cache=True, disable_overlap_schedule=True)
    cached = run(tiny_llama_dir, arrivals, chunked_prefill_size=16, max_total_tokens=120, page_size=4,
                 schedule_conservativeness=0.3, enable_mixed_chunk=mixed,
                 disable_overlap_schedule=not overlap)
    if mixed:
        assert cached.sched.decode.num_mixed_steps >= 5
    assert cached.sched.cache.matched_tokens > 200, "the load must hit the cache"
    assert cached.sched.decode.total_retractions >= 1, "the small pool must retract"
    assert sum(r.cache_hit_tokens for r in cached.reqs.values()) > 0
    partings = []
    for rid in ref.reqs:
        a, b = cached.reqs[rid], ref.reqs[rid]
        assert finish_json(a.finish)["type"] in ("stop", "length")
        pos = greedy_parting(a.output_ids, [[t for _, t in top] for top in a.output_top_logprobs],
                             b.output_ids, [[t for _, t in top] for top in b.output_top_logprobs])
        if pos is None:
            assert a.finish == b.finish
        else:
            partings.append((rid, pos))
    assert not partings, partings  # wide random weights: no near-ties expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_with_pages_of_16_a_repeated_prompt_reuses_all_but_its_last_token_and_answers_alike(
        tiny_llama_dir, overlap):
    """The copy path with the real model: a repeated 6-token prompt (no whole
    page to share), a 35-token one (two pages and 2 rows) and an 82-token one
    report cached_tokens = prompt - 1 and the greedy output of a run without
    the cache; so does a second turn built on the first's answer."""
    rng = random.Random(1)
    prompts = {n: [rng.randrange(3, 512) for _ in range(n)] for n in (6, 35, 82)}
    ref = Engine(tiny_llama_dir, ignore_eos=True, disable_radix_cache=True)
    eng = Engine(tiny_llama_dir, ignore_eos=True, page_size=16, disable_overlap_schedule=not overlap)
    for n, prompt in prompts.items():
        for e in (ref, eng):
            e.run({0: [(f"first{n}", prompt, 6)]})
            e.run({0: [(f"again{n}", prompt, 6)]})
        turn2 = prompt + eng.reqs[f"first{n}"].output_ids + [7, 8, 9]
        for e in (ref, eng):
            e.run({0: [(f"turn2_{n}", turn2, 6)]})
        assert eng.reqs[f"first{n}"].cache_hit_tokens == 0
        assert eng.reqs[f"again{n}"].cache_hit_tokens == n - 1
        assert eng.reqs[f"turn2_{n}"].cache_hit_tokens == n + 6 - 1
        for rid in (f"first{n}", f"again{n}", f"turn2_{n}"):
            a, b = eng.reqs[rid], ref.reqs[rid]
            assert greedy_parting(a.output_ids, [[t for _, t in top] for top in a.output_top_logprobs],
                                  b.output_ids, [[t for _, t in top] for top in b.output_top_logprobs]) is None, rid
    eng.assert_no_leak()
