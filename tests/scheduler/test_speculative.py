"""Speculative decoding (--speculative-algorithm NGRAM) inside continuous
batching: outputs equal to the run without it, KV accounts exact after every
step, under retraction, chunked prefill, aborts, stop tokens, pages and the
overlap schedule; and the policy that decides when a verify pays."""

from __future__ import annotations

import random

import pytest

from common.messages import AbortReq, ForwardMode, SamplingParams, ThinkingBudgetSpec, TokenizedGenerateReq
from common.server_args import ServerArgs
from scheduler_proc.create import create_scheduler
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.speculative.policy import Acceptance, CostLine
from tests.scheduler.fake_model import FakeModel, fake_model_info
from tests.scheduler.test_scheduler import assert_no_leak
from tokenizer_proc.finish_json import finish_json


def run_load(seed: int, speculate: bool, aborts: bool = False, eos_one_in: int = 0, jitter: int = 5, **args):
    """A seeded random load on the fake model, driven step by step with the
    KV accounts checked after every step. Returns (per rid: tokens, finish),
    the scheduler and the model."""
    rng = random.Random(seed)
    args.setdefault("enable_mixed_chunk", False)
    args = ServerArgs(model_path="fake", max_running_requests=6,
                      speculative_algorithm="NGRAM" if speculate else "", **args)
    model = FakeModel(eos_one_in=eos_one_in, jitter_one_in=jitter)
    outputs: list = []
    sched = create_scheduler(args, fake_model_info(max_total_tokens=args.max_total_tokens or 4096), model,
                             outputs.append)
    arrivals: dict[int, list[TokenizedGenerateReq]] = {}
    for i in range(16):
        # prompts that repeat themselves, so prompt lookup finds drafts; the
        # fake model's next token is a function of the last one, so outputs loop
        unit = [rng.randrange(10, 1000) for _ in range(rng.randint(2, 6))]
        prompt = (unit * 8)[:rng.randint(4, 40)]
        stops = [rng.randrange(10, 1000) for _ in range(3)] if rng.random() < 0.3 else []
        # some rows penalized: they verify with no drafts of their own, beside rows that draft
        sp = SamplingParams(max_new_tokens=rng.randint(1, 60), temperature=0.0, stop_token_ids=stops,
                            frequency_penalty=0.5 if rng.random() < 0.25 else 0.0)
        arrivals.setdefault(rng.randrange(0, 30), []).append(
            TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling_params=sp))
    abort_at = {rng.randrange(5, 40): f"r{i}" for i in rng.sample(range(16), 3)} if aborts else {}
    for step in range(2000):
        sched.process_input_requests(arrivals.pop(step, []))
        if step in abort_at:
            sched.process_input_requests([AbortReq(rid=abort_at[step])])
        batch = sched.step()
        error = check_kv_invariant(sched.cache)
        assert error is None, f"step {step}: {error}"
        if batch is None and not arrivals and sched.is_idle():
            break
    else:
        raise AssertionError("the scheduler did not go idle")
    assert_no_leak(sched)
    results: dict[str, tuple[list[int], dict]] = {}
    for msg in outputs:
        for rid, new, reason in zip(msg.rids, msg.new_token_ids, msg.finished_reasons):
            tokens, _ = results.get(rid, ([], None))
            results[rid] = (tokens + list(new), finish_json(reason) if reason is not None else None)
    return results, sched, model


LOADS = {
    "roomy": {},
    "retracting": {"max_total_tokens": 200, "schedule_conservativeness": 0.05},
    "chunked": {"chunked_prefill_size": 8},
    "paged": {"page_size": 16, "max_total_tokens": 1024},
    "mixed": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},  # running rows decode inside prefills
    "eos": {"eos": 7},
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("load", list(LOADS))
def test_outputs_equal_the_run_without_speculation(load, overlap):
    args = dict(LOADS[load], disable_overlap_schedule=not overlap)
    eos = args.pop("eos", 0)
    for seed in range(3):
        ref, _, _ = run_load(seed, speculate=False, eos_one_in=eos, **args)
        got, sched, model = run_load(seed, speculate=True, eos_one_in=eos, **args)
        assert got == ref, f"seed {seed}"
        assert all(reason is not None for _, reason in got.values())
        stats = sched.speculator.stats
        # drafts were verified, some kept and some rejected (their KV given back)
        assert model.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
        # the timeline (the dashboard's) counts each verify step's kept drafts
        steps = [e for e in sched.timeline.events if e["type"] == "step" and e["kind"] == "verify"]
        assert len(steps) == model.verify_steps and sum(e["accepted"] for e in steps) == stats.accepted
        if load == "retracting":
            assert sched.decode.total_retractions > 0
        if load == "mixed":
            assert sched.decode.num_mixed_steps > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_aborted_requests_end_with_a_prefix_of_their_output(overlap):
    ref, _, _ = run_load(5, speculate=False, disable_overlap_schedule=not overlap)
    got, _, _ = run_load(5, speculate=True, aborts=True, disable_overlap_schedule=not overlap)
    aborted = [rid for rid, (_, reason) in got.items() if reason["type"] == "abort"]
    assert aborted
    for rid, (tokens, reason) in got.items():
        full = ref[rid][0]
        if reason["type"] == "abort":
            assert tokens == full[:len(tokens)]
        else:
            assert (tokens, reason) == ref[rid]


def test_max_new_tokens_is_never_exceeded_and_drafts_stop_short_of_it():
    got, sched, model = run_load(2, speculate=True)
    for batch in model.batches:
        if batch.forward_mode is ForwardMode.VERIFY:
            assert len(batch.input_ids) > len(batch.req_pool_indices)
    for rid, (tokens, reason) in got.items():
        if reason["type"] == "length":
            assert len(tokens) == reason["length"]


def test_cost_line_follows_the_steps_it_sees_and_keeps_its_prior_while_they_are_all_alike():
    cost = CostLine(0.010, 0.001)  # the start-up prior
    assert cost.line() == pytest.approx((0.010, 0.001))
    for _ in range(300):  # the machine turned out slower per token
        for n in (1, 4, 12):
            cost.observe(n, 0.012 + 0.003 * n)
    assert cost.line() == pytest.approx((0.012, 0.003), rel=0.05)
    same = CostLine(0.010, 0.001)
    for _ in range(300):  # every step 8 tokens: the data say nothing of the slope
        same.observe(8, 0.030)
    fixed, per_token = same.line()
    assert per_token == pytest.approx(0.001, rel=0.2) and fixed + 8 * per_token == pytest.approx(0.030, rel=0.05)


def test_acceptance_counts_a_verify_as_the_geometric_model_does():
    a = Acceptance()
    a.add(drafted=4, accepted=2, decay=1.0)  # two kept, the third rejected, the fourth never decided
    a.add(drafted=3, accepted=3, decay=1.0)  # all kept: no failure seen
    assert (a.successes, a.trials) == (5, 6)
    assert a.rate(prior=0.5, weight=2.0) == pytest.approx(6 / 8)


def test_the_policy_keeps_drafts_while_they_pay_and_none_in_a_large_batch():
    from scheduler_proc.req import Req
    from scheduler_proc.speculative.policy import Speculator

    def reqs(n: int, rate: float) -> list[Req]:
        out = []
        for i in range(n):
            r = Req(rid=f"r{i}", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=100),
                    stop_token_ids=frozenset(), output_ids=[4])
            spec.state(r).acceptance = Acceptance(1000 * rate, 1000)  # a rate known for sure
            out.append(r)
        return out

    spec = Speculator(ServerArgs(model_path="fake", speculative_algorithm="NGRAM"), (0.020, 0.001), 4096)
    drafts = [[5, 6, 7, 8, 9, 10, 11]]
    # one row, drafts usually right: all kept; usually wrong: none
    assert spec.choose(reqs(1, 0.95), drafts) == drafts
    assert spec.choose(reqs(1, 0.02), drafts) is None
    # at 64 rows the fixed cost is shared already: even good drafts do not pay
    assert spec.choose(reqs(64, 0.5), drafts * 64) is None
    # a middling rate at one row: the first drafts pay, the far ones not
    kept = spec.choose(reqs(1, 0.6), drafts)
    assert kept is not None and 0 < len(kept[0]) < 7
    # asked before waiting for the step in flight: a large batch keeps its overlap
    assert spec.may_pay(reqs(1, 0.5)) and not spec.may_pay(reqs(64, 0.5))
    # a verify step slower than its line said (a tile path, say): fewer drafts pay
    for _ in range(200):
        spec.verify_cost.observe(8, 0.080)
    assert spec.choose(reqs(1, 0.6), drafts) is None
    # a verify line cheaper than the decode steps seen (its prior from short probes, extrapolated):
    # a verify of n tokens is priced at least as a decode step of n rows, so a large batch keeps its overlap
    cheap = Speculator(ServerArgs(model_path="fake", speculative_algorithm="NGRAM"), (0.004, 0.003), 4096)
    for _ in range(300):
        for n in (24, 32):
            cheap.decode_cost.observe(n, 0.002 + 0.0043 * n)
    assert cheap.verify_cost.seconds(32) < cheap.decode_cost.seconds(32)
    assert cheap.verify_seconds(32) == cheap.decode_cost.seconds(32)
    assert not cheap.may_pay(reqs(32, 0.8))
    # a fresh server's prior is optimistic: a new row's first drafts are verified
    fresh = Speculator(ServerArgs(model_path="fake", speculative_algorithm="NGRAM"), (0.020, 0.001), 4096)
    row = Req(rid="n", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=100),
              stop_token_ids=frozenset(), output_ids=[4])
    assert fresh.choose([row], drafts) is not None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tiny_model_greedy_and_seeded_outputs_equal_the_run_without_speculation(tiny_llama_dir, kv_cache_dtype):
    """The real model (tiny, random weights) in process, overlap schedule on
    (the fake-model loads above cover the plain loop). A repeated request
    drafts from the first one's output (the table of recent outputs), so most
    drafts are right; the rest are checked as well. Seeded sampled rows draw
    each token with (seed, step), so they too must match token for token.
    With an int8 KV cache too: a verify stores and reads its tokens' K/V as
    decode steps do (rows rounded per token and head)."""
    overlap = True
    from tests.scheduler.test_engine_matches_transformers import Engine

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 11, 20)]

    def run(speculate: bool):
        engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=600,
                        disable_overlap_schedule=not overlap, kv_cache_dtype=kv_cache_dtype,
                        speculative_algorithm="NGRAM" if speculate else "",
                        disable_speculative_adaptive=speculate)  # every draft: this test is of exactness
        sched = engine.sched
        assert engine.runner.kv_pool.int8 == (kv_cache_dtype == "int8")
        engine.batches = []
        forward = engine.runner.forward
        engine.runner.forward = lambda b: (engine.batches.append(b), forward(b))[1]
        # "pen": a penalized row, verified beside the others with no drafts of its own
        plan = {0: [("g0", 0, 0.0), ("s0", 1, 1.0)], 2: [("g1", 2, 0.0)],
                45: [("g0b", 0, 0.0), ("s0b", 1, 1.0), ("pen", 2, 0.0)], 50: [("g1b", 2, 0.0)]}
        for step in range(3000):
            for rid, p, temperature in plan.pop(step, []):
                sp = SamplingParams(max_new_tokens=30, temperature=temperature, top_k=40, seed=11,
                                    ignore_eos=True, frequency_penalty=0.8 if rid == "pen" else 0.0)
                sched.process_input_requests([TokenizedGenerateReq(
                    rid=rid, input_ids=prompts[p], sampling_params=sp, return_logprob=True)])
                engine.reqs[rid] = sched.queue.by_rid[rid]
            if sched.step() is None and not plan and sched.is_idle():
                break
            assert check_kv_invariant(sched.cache) is None
        engine.assert_no_leak()
        return engine

    ref, got = run(False), run(True)
    # the penalized row went through verify steps beside drafting rows
    assert any(b.forward_mode is ForwardMode.VERIFY and b.penalty_rows and len(b.input_ids) > len(b.seq_lens)
               for b in got.batches)
    stats = got.sched.speculator.stats
    assert stats.accepted >= 20, stats  # the repeats drafted from the first requests' outputs
    for rid, req in ref.reqs.items():
        assert got.reqs[rid].output_ids == req.output_ids, rid
        assert got.reqs[rid].output_token_logprobs == pytest.approx(req.output_token_logprobs, abs=1e-4)


def test_a_thinking_budget_row_drafts_up_to_its_budget_and_verifies_its_forced_tag(tiny_llama_dir):
    """A row with a thinking budget takes part in verify steps: while it thinks
    it drafts, never past the budget (its tokens are sampled freely, so the
    budget's end must fall between steps), and each token of its forced
    closing tag is sampled under its one-token mask in a verify step beside
    rows that draft. Outputs equal the run without speculation, the tag right
    after `budget` thinking tokens."""
    from scheduler_proc.thinking_budget import ThinkingPhase
    from tests.scheduler.test_engine_matches_transformers import Engine

    end, budget = [301, 302], 7
    rng = random.Random(5)
    prompt = [rng.randrange(3, 300) for _ in range(12)]

    def run(speculate: bool):
        engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=600,
                        speculative_algorithm="NGRAM" if speculate else "",
                        disable_speculative_adaptive=speculate)  # every draft: this test is of exactness
        sched = engine.sched
        proposed: list[tuple[ThinkingPhase, int]] = []  # the budget row's phase and drafts at each verify
        if speculate:
            propose = sched.speculator.propose

            def spy(reqs):
                drafts = propose(reqs)
                proposed.extend((r.thinking.phase, len(d)) for r, d in zip(reqs, drafts or [])
                                if r.rid == "budget")
                return drafts
            sched.speculator.propose = spy
        # "first" finishes before the others start: its output is the table's,
        # which the two repeats of its prompt draft from
        plan = {0: [("first", None)], 40: [("budget", ThinkingBudgetSpec(budget=budget, end_ids=end)),
                                           ("again", None)]}
        for step in range(3000):
            for rid, spec in plan.pop(step, []):
                sched.process_input_requests([TokenizedGenerateReq(
                    rid=rid, input_ids=prompt, thinking_budget=spec,
                    sampling_params=SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))])
                engine.reqs[rid] = sched.queue.by_rid[rid]
            if sched.step() is None and not plan and sched.is_idle():
                break
            assert check_kv_invariant(sched.cache) is None
        engine.assert_no_leak()
        return {rid: r.output_ids for rid, r in engine.reqs.items()}, proposed

    (ref, _), (got, proposed) = run(False), run(True)
    assert got == ref
    assert got["budget"][:budget] == got["first"][:budget] and got["budget"][budget:budget + 2] == end
    assert any(phase is ThinkingPhase.THINKING and n > 0 for phase, n in proposed), proposed
    assert sum(phase is ThinkingPhase.FORCING for phase, _ in proposed) == 2, proposed  # each tag token
    assert all(n == 0 for phase, n in proposed if phase is ThinkingPhase.FORCING)


def test_grammar_rows_verify_drafts_under_their_masks_and_answer_as_without_speculation(default_model_dir):
    """The default model asked to repeat a JSON object, constrained by its
    schema: the drafts (the object, looked up in the prompt) are cut where the
    grammar rejects them and each verified token is sampled under its own
    mask; answers equal the run without speculation, greedy and seeded, and
    validate."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from common.messages import Grammar, GrammarKind
    from tests.scheduler.test_engine_matches_transformers import Engine
    from tests.scheduler.test_structured_output import run_all

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    doc = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "notes": "first program"}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "born": {"type": "integer"},
                                               "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                               "notes": {"type": "string", "maxLength": 40}},
              "required": ["name", "born", "fields", "notes"], "additionalProperties": False}
    text = tok.apply_chat_template([{"role": "user", "content": f"Repeat this JSON exactly: {json.dumps(doc)}"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    reqs = [("greedy", prompt, SamplingParams(max_new_tokens=64, temperature=0.0, grammar=grammar)),
            ("seeded", prompt, SamplingParams(max_new_tokens=64, temperature=0.7, seed=5, grammar=grammar))]
    runs = {}
    for speculate in (False, True):
        engine = Engine(default_model_dir, ignore_eos=False, dtype="auto", max_running_requests=4,
                        speculative_algorithm="NGRAM" if speculate else "",
                        disable_speculative_adaptive=speculate)
        runs[speculate] = (run_all(engine, reqs), engine)
    (ref, _), (got, engine) = runs[False], runs[True]
    assert engine.sched.speculator.stats.accepted > 10
    for rid, _, sp in reqs:
        assert got[rid].output_ids == ref[rid].output_ids, rid
        if sp.grammar is not None:
            jsonschema.validate(json.loads(tok.decode(got[rid].output_ids, skip_special_tokens=True)), schema)
