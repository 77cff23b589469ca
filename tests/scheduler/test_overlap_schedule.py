"""The overlap schedule: the scheduler sends step t+1 before it reads step t's
result (the model fills in the tokens it has not seen yet), and every request
still gets exactly the output of the plain loop."""

from __future__ import annotations

import random
from collections import deque

import pytest

from common.messages import (FUTURE_TOKEN, AbortReq, BatchTokenOut, ForwardBatch, ForwardResult,
                             SamplingParams, TokenizedGenerateReq)
from common.server_args import ServerArgs
from scheduler_proc.scheduler import Scheduler
from tests.scheduler.fake_model import FakeModel, fake_model_info
from tests.scheduler.test_engine_matches_transformers import Engine
from tests.scheduler.test_scheduler import Harness, expected_tokens
from tokenizer_proc.finish_json import finish_json


def streamed(outputs: list[BatchTokenOut]) -> dict[str, tuple[list[int], dict]]:
    """Per rid: every token streamed, and the one finish reason. Fails on a
    second finish or on tokens after the finish."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, dict] = {}
    for msg in outputs:
        for rid, new, reason in zip(msg.rids, msg.new_token_ids, msg.finished_reasons):
            assert rid not in finals, f"{rid}: output after its finish"
            tokens.setdefault(rid, []).extend(new)
            if reason is not None:
                finals[rid] = finish_json(reason)  # as the client sees it
    assert set(finals) == set(tokens)
    return {rid: (tokens[rid], finals[rid]) for rid in tokens}


def random_load(seed: int, overlap: bool, batching: str, aborts: bool = False,
                radix_cache: bool = True, **args) -> Harness:
    """Requests arriving over 40 steps, some streamed, in a pool small enough to
    retract, prefilled in chunks, finishing on stop tokens or on length (and,
    with `aborts`, some aborted at a random step)."""
    rng = random.Random(seed)
    pool = rng.randint(60, 300)
    h = Harness(max_running=rng.randint(1, 12), max_total_tokens=pool,
                chunked_prefill_size=rng.choice([-1, 8, 32]), eos_one_in=rng.choice([0, 5, 20]),
                batching=batching, batch_timeout_ms=0, disable_overlap_schedule=not overlap,
                disable_radix_cache=not radix_cache, **args)
    arrivals: dict[int, list] = {}
    for i in range(rng.randint(5, 30)):
        n_prompt = rng.randint(1, 40)
        max_new = rng.randint(1, min(60, pool - n_prompt))
        arrivals.setdefault(rng.randint(0, 40), []).append(
            (f"r{i}", n_prompt, max_new, rng.random() < 0.5))
    rids = [rid for reqs in arrivals.values() for rid, *_ in reqs]
    abort_at = {rng.randint(0, 80): rng.choice(rids) for _ in range(len(rids) // 3)} \
        if aborts else {}
    for step in range(20_000):
        for rid, n_prompt, max_new, stream in arrivals.get(step, []):
            h.submit(rid, n_prompt, max_new, stream=stream)
        if step in abort_at:
            h.sched.process_input_requests([AbortReq(rid=abort_at[step])])
        if h.sched.step() is None and step > 80 and h.sched.is_idle():
            break
    h.assert_no_leak()
    return h


@pytest.mark.parametrize("batching,radix_cache", [("continuous", False), ("continuous", True),
                                                  ("static", False), ("dynamic", False)])
def test_overlap_gives_the_plain_loops_outputs_under_random_load(batching, radix_cache, property_seeds):
    """Same tokens and finish reasons; without the prefix cache also the same
    retractions. (With it, the overlap inserts a prompt into the cache one step
    later, so a request arriving in between may miss it and admission differs.)"""
    retractions = 0
    for seed in property_seeds:
        on = random_load(seed, True, batching, radix_cache=radix_cache)
        off = random_load(seed, False, batching, radix_cache=radix_cache)
        assert streamed(on.outputs) == streamed(off.outputs), f"seed {seed}"
        if not radix_cache:
            assert on.sched.decode.total_retractions == off.sched.decode.total_retractions
        retractions += on.sched.decode.total_retractions
    assert batching != "continuous" or retractions > 0  # the loads did retract


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_aborts_at_random_steps_with_overlap_cut_outputs_short_and_leak_nothing(batching, property_seeds):
    for seed in property_seeds:
        cut = streamed(random_load(seed, True, batching, aborts=True).outputs)  # no leak either
        full = streamed(random_load(seed, False, batching).outputs)
        assert set(cut) == set(full)
        for rid, (tokens, reason) in cut.items():
            if reason["type"] == "abort":
                assert tokens == full[rid][0][:len(tokens)], (seed, rid)
            else:
                assert (tokens, reason) == full[rid], (seed, rid)


class LazyModel:
    """A model client that computes a step only when its result is read, and
    logs sends and reads: the scheduler cannot have used a result it never read."""

    def __init__(self) -> None:
        self.fake = FakeModel()
        self.queue: deque[tuple[int, ForwardBatch]] = deque()
        self.log: list[tuple[str, int]] = []
        self.sent = 0

    def send(self, batch: ForwardBatch) -> None:
        self.log.append(("send", self.sent))
        self.queue.append((self.sent, batch))
        self.sent += 1

    def recv(self) -> ForwardResult:
        k, batch = self.queue.popleft()
        self.log.append(("recv", k))
        return self.fake.forward(batch)


def run_with(model, overlap: bool, reqs: list[tuple[str, int, int]]) -> list[BatchTokenOut]:
    outputs: list[BatchTokenOut] = []
    args = ServerArgs(model_path="fake", max_running_requests=4,
                      disable_overlap_schedule=not overlap)
    sched = Scheduler(args, fake_model_info(), model, outputs.append)
    for rid, n_prompt, max_new in reqs:
        sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=[(i * 13 + len(rid)) % 900 + 10 for i in range(n_prompt)],
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0))])
    for _ in range(100):
        if sched.step() is None and sched.is_idle():
            break
    assert sched.cache.available() == sched.cache.size and not sched.cache.resident
    return outputs


def test_model_receives_step_t_plus_1_before_the_scheduler_reads_result_t():
    reqs = [("a", 5, 8), ("b", 3, 6)]
    model = LazyModel()
    outputs = run_with(model, True, reqs)
    log = model.log
    assert model.sent > 6
    # every step but the last is followed by the next one's send before its result is read
    for k in range(model.sent - 1):
        assert log.index(("send", k + 1)) < log.index(("recv", k)), log
    # decode inputs the scheduler had not seen yet went out as FUTURE_TOKEN
    decodes = [b for b in model.fake.batches if b.forward_mode == "decode"]
    assert all(t == FUTURE_TOKEN for b in decodes for t in b.input_ids)
    # and the outputs are the plain loop's
    plain = LazyModel()
    assert streamed(outputs) == streamed(run_with(plain, False, reqs))
    assert plain.log == [(kind, k) for k in range(plain.sent) for kind in ("send", "recv")]
    assert all(t != FUTURE_TOKEN for b in plain.fake.batches for t in b.input_ids)


def rows_computed(h: Harness, row: int) -> int:
    return sum(row in b.req_pool_indices for b in h.model.batches)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_stop_token_ends_the_output_exactly_and_the_late_row_is_thrown_away(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=3, max_new=50, stream=True)
    h.submit("b", n_prompt=4, max_new=12, stream=True)  # keeps the batch going
    req = h.sched.queue.waiting[0]
    tokens = expected_tokens(req.origin_input_ids[-1], 6)
    req.stop_token_ids = frozenset({tokens[2]})
    h.sched.step()
    row = req.req_pool_idx
    h.run_until_idle()
    out = streamed(h.outputs)
    assert out["a"] == (tokens[:3], {"type": "stop", "matched": tokens[2]})
    # prefill + 2 decode steps; with overlap one more decode step was computed
    # before the scheduler saw the stop token, and its token was discarded
    assert rows_computed(h, row) == 3 + overlap
    assert len(out["b"][0]) == 12
    h.assert_no_leak()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_max_new_tokens_is_exact_and_no_step_runs_past_it(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=3, max_new=5, stream=True)
    h.submit("b", n_prompt=4, max_new=12)
    prompt_last = h.sched.queue.waiting[0].origin_input_ids[-1]
    h.sched.step()
    row = h.sched.queue.by_rid["a"].req_pool_idx
    h.run_until_idle()
    out = streamed(h.outputs)
    assert out["a"] == (expected_tokens(prompt_last, 5), {"type": "length", "length": 5})
    # a length finish is known before the token arrives: the row is not sent again
    assert rows_computed(h, row) == 5
    h.assert_no_leak()


def test_abort_while_its_step_is_in_flight_frees_the_kv_and_sends_nothing_more():
    h = Harness(disable_overlap_schedule=False)
    h.submit("a", n_prompt=10, max_new=100, stream=True)
    h.submit("bb", n_prompt=10, max_new=5)  # a prompt of its own: nothing of a's is shared
    h.sched.step()  # prefill a and bb: in flight
    h.sched.step()  # decode sent, prefill result read; the decode is in flight
    assert h.sched.inflight
    used_before = h.sched.cache.size - h.sched.cache.available()  # held by requests
    h.sched.process_input_requests([AbortReq(rid="a")])
    used_after = h.sched.cache.size - h.sched.cache.available()
    assert used_before - used_after == 11  # its prompt and the slot of the step in flight
    h.run_until_idle()
    out = streamed(h.outputs)  # nothing for "a" after its abort
    assert out["a"][1]["type"] == "abort" and len(out["a"][0]) == 1
    assert out["bb"][1] == {"type": "length", "length": 5}
    h.assert_no_leak()


def real_model_run(model_dir: str, overlap: bool, arrivals, stops: dict[str, int]) -> Engine:
    engine = Engine(model_dir, ignore_eos=False, max_running_requests=4, max_total_tokens=70, page_size=4,
                    chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    step = 0
    while True:
        for rid, prompt, n in arrivals.get(step, []):
            seeded = rid == "seeded"  # sampled: its draw depends on (seed, step) only
            sp = SamplingParams(max_new_tokens=n, temperature=0.8 if seeded else 0.0,
                                seed=7 if seeded else None,
                                stop_token_ids=[stops[rid]] if rid in stops else [])
            engine.sched.process_input_requests([TokenizedGenerateReq(
                rid=rid, input_ids=prompt, sampling_params=sp, return_logprob=True,
                top_logprobs_num=3)])
            engine.reqs[rid] = engine.sched.queue.by_rid[rid]
        if engine.sched.step() is None and step > max(arrivals) and engine.sched.is_idle():
            break
        step += 1
        assert step < 10_000
    engine.assert_no_leak()
    return engine


def test_tiny_model_greedy_outputs_and_logprobs_are_identical_with_overlap_on_and_off(
        tiny_llama_dir):
    rng = random.Random(3)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    # arrivals at different steps; a 40-token prompt prefilled in chunks of 16;
    # a pool of 70 that must retract; finishes on EOS ("a", "e"), on a stop
    # token ("c", "g") and on length, at different steps
    arrivals = {
        0: [("a", prompt(12), 30), ("b", prompt(40), 20), ("seeded", prompt(6), 15)],
        3: [("c", prompt(5), 40), ("d", prompt(9), 3)],
        8: [("e", prompt(20), 30), ("f", prompt(2), 1), ("g", prompt(7), 40)],
    }
    free = real_model_run(tiny_llama_dir, False, arrivals, {})
    # stop "c" and "g" on a token they produce midway (or at its first occurrence)
    stops = {rid: free.reqs[rid].output_ids[k] for rid, k in (("c", 10), ("g", 20))}
    runs = {overlap: real_model_run(tiny_llama_dir, overlap, arrivals, stops)
            for overlap in (True, False)}
    for overlap, engine in runs.items():
        assert engine.sched.decode.total_retractions >= 1, overlap
        events = [e["event"] for e in engine.sched.timeline.events if e["type"] == "req"]
        assert "chunk" in events
    on, off = runs[True], runs[False]
    for rid, req in off.reqs.items():
        other = on.reqs[rid]
        assert other.output_ids == req.output_ids, rid
        assert other.finish == req.finish, rid
        assert other.output_token_logprobs == pytest.approx(req.output_token_logprobs, abs=1e-4)
        assert [[t for _, t in top] for top in other.output_top_logprobs] == \
            [[t for _, t in top] for top in req.output_top_logprobs]
    for rid in ("a", "e", "c", "g"):
        assert finish_json(off.reqs[rid].finish)["type"] == "stop", rid
    assert finish_json(off.reqs["b"].finish) == {"type": "length", "length": 20}
    assert streamed(on.outputs) == streamed(off.outputs)


def test_disable_overlap_schedule_flag_selects_the_plain_loop():
    assert ServerArgs.from_cli(["--model-path", "fake"]).disable_overlap_schedule is False
    args = ServerArgs.from_cli(["--model-path", "fake", "--disable-overlap-schedule"])
    assert args.disable_overlap_schedule is True
    assert not Scheduler(args, fake_model_info(), FakeModel(), lambda msg: None).overlap
