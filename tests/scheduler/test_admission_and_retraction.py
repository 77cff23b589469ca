"""Admission budget, new_token_ratio, retraction, chunked prefill, policies and
batching modes, driven by the fake model (no network, no weights)."""

from __future__ import annotations

import logging
import random
import time
from collections import deque

import pytest
import numpy as np

from common.messages import SamplingParams
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.policy import MAX_PASS_OVER_S, order_waiting_queue
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import OutOfKVSlots
from tests.scheduler.test_scheduler import MODES, Harness


def test_new_token_ratio_decays_each_decode_step_and_resets_when_idle():
    h = Harness(max_running=2)
    s = h.sched
    assert s.ratio.value == pytest.approx(0.7)
    assert s.ratio.min == pytest.approx(0.7 * 0.14)
    h.submit("a", n_prompt=4, max_new=30)
    for _ in range(11):  # 1 prefill + 10 decode steps
        s.step()
    assert s.ratio.value == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    h.run_until_idle()
    s.step()
    assert s.ratio.value == pytest.approx(0.7)


def test_schedule_conservativeness_scales_the_ratio():
    h = Harness(schedule_conservativeness=1.3)
    assert h.sched.ratio.value == pytest.approx(0.91)


def test_admission_counts_ignore_eos_requests_at_ratio_one():
    # pool 100: a running ignore_eos request with 60 tokens to go reserves 60, not 42
    h = Harness(max_running=4, max_total_tokens=100)
    h.submit("a", n_prompt=10, max_new=61, ignore_eos=True)
    h.sched.step()
    h.submit("bb", n_prompt=10, max_new=30)  # needs 10 + 21 = 31 > 100 - 11 - 60 = 29 (own prompt)
    batch = h.sched.step()
    assert batch.forward_mode == "decode" and [r.rid for r in batch.reqs] == ["a"]
    h.run_until_idle()
    h.assert_no_leak()


@MODES
def test_retraction_frees_kv_requeues_at_front_and_counts(caplog, overlap):
    caplog.set_level(logging.INFO)
    # 6 requests of 10 + 30 tokens in a pool of 100: admission at ratio 0.7
    # admits three (3 x 31 <= 100), which then need 3 x 40 > 100
    h = Harness(max_running=8, max_total_tokens=100, disable_overlap_schedule=not overlap)
    for i in range(6):
        h.submit(f"r{i}", n_prompt=10, max_new=30)
    h.run_until_idle()
    finals = h.finals()
    assert all(f[0] == {"type": "length", "length": 30} for f in finals.values())
    assert h.sched.decode.total_retractions >= 1
    retracted = {m.rids[i]: m.num_retractions[i] for m in h.outputs for i in range(len(m.rids))
                 if m.finished_reasons[i] is not None}
    assert sum(retracted.values()) == h.sched.decode.total_retractions
    assert "KV cache pool is full. Retract requests. #retracted_reqs: " in caplog.text
    assert "#new_token_ratio: " in caplog.text
    h.assert_no_leak()
    # recomputed requests produce exactly what they produce with a big pool
    big = Harness(max_running=8, max_total_tokens=1000)
    for i in range(6):
        big.submit(f"r{i}", n_prompt=10, max_new=30)
    big.run_until_idle()
    assert big.sched.decode.total_retractions == 0
    for rid in finals:
        assert h.tokens(rid) == big.tokens(rid)


def test_retraction_picks_fewest_decoded_then_longest_prompt():
    h = Harness(max_running=8, max_total_tokens=200)
    s = h.sched
    h.submit("old", n_prompt=5, max_new=100)
    s.step()
    for _ in range(5):
        s.step()
    h.submit("short_prompt", n_prompt=5, max_new=100)
    h.submit("long_prompt", n_prompt=9, max_new=100)
    s.step()  # prefill both: 1 token each; "old" has 6
    s.step()
    s.resolve_inflight()  # with overlap a step is still out: victims need all their tokens
    batch = s.decode.running_batch
    # take every free slot so that the next decode needs a retraction
    hog = s.cache.allocator.alloc_pages(s.cache.allocator.available() - 2)  # pages of 1 slot
    s.decode.retract_decode(batch)
    assert [r.rid for r in s.queue.waiting] == ["long_prompt"]
    assert [r.rid for r in batch.reqs] == ["old", "short_prompt"]
    s.cache.allocator.free(s.cache.allocator.first_slots(hog))
    h.run_until_idle()
    h.assert_no_leak()


@pytest.mark.parametrize("page_size", [1, 4])
@MODES
def test_kv_pool_never_overflows_under_random_load(overlap, page_size, property_seeds):
    """Property: whatever the arrivals and lengths, admission plus retraction
    never asks the allocator for a slot it does not have, every request ends
    with its full output, and nothing leaks; with a slot per token and with
    pages of several."""
    for seed in property_seeds:
        rng = random.Random(seed)
        pool = rng.randint(60, 300)
        h = Harness(max_running=rng.randint(1, 12), max_total_tokens=pool,
                    chunked_prefill_size=rng.choice([-1, 8, 32]), page_size=page_size,
                    eos_one_in=rng.choice([0, 5, 20]), disable_overlap_schedule=not overlap)
        expected = {}
        arrivals = {}
        for i in range(rng.randint(5, 30)):
            n_prompt = rng.randint(1, 40)
            max_new = rng.randint(1, min(60, pool // page_size * page_size - n_prompt))
            arrivals.setdefault(rng.randint(0, 40), []).append((f"r{i}", n_prompt, max_new))
            expected[f"r{i}"] = max_new
        step = 0
        try:
            while step < 20_000:
                for rid, n_prompt, max_new in arrivals.get(step, []):
                    h.submit(rid, n_prompt, max_new)
                used = h.sched.cache.allocator.size - h.sched.cache.allocator.available()
                assert 0 <= used <= pool
                assert check_kv_invariant(h.sched.cache) is None, (seed, check_kv_invariant(h.sched.cache))
                if h.sched.step() is None and step > 40 and h.sched.is_idle():
                    break
                step += 1
        except OutOfKVSlots as e:  # pragma: no cover - the failure this test hunts
            pytest.fail(f"seed {seed}: the pool overflowed: {e}")
        finals = h.finals()
        assert set(finals) == set(expected), f"seed {seed}"
        for rid, (reason, n) in finals.items():
            assert reason["type"] in ("length", "stop"), (seed, rid, reason)
            assert n <= expected[rid]
            assert reason["type"] == "stop" or n == expected[rid]
        h.assert_no_leak()


def test_request_too_big_for_the_pool_even_alone_gets_an_error():
    h = Harness(max_total_tokens=50)
    h.submit("big", n_prompt=30, max_new=30)
    reason = h.finals()["big"][0]
    assert reason["type"] == "abort" and "even alone" in reason["message"]
    h.assert_no_leak()


def test_chunked_prefill_splits_a_long_prompt_and_keeps_it_out_of_the_running_batch():
    h = Harness(max_running=4, chunked_prefill_size=16, max_consecutive_prefill_batches=1)
    h.submit("short", n_prompt=4, max_new=20)
    h.sched.step()  # prefill "short"
    h.submit("long", n_prompt=50, max_new=3)
    kinds = []
    for _ in range(10):
        b = h.sched.step()
        kinds.append((b.forward_mode, [r.rid for r in b.reqs], len(b.input_ids)))
    # chunks of 16, 16, 16, 2 alternate with decode steps of "short" alone
    assert kinds[:8] == [
        ("extend", ["long"], 16), ("decode", ["short"], 1),
        ("extend", ["long"], 16), ("decode", ["short"], 1),
        ("extend", ["long"], 16), ("decode", ["short"], 1),
        ("extend", ["long"], 2), ("decode", ["short", "long"], 2)]
    h.run_until_idle()
    h.assert_no_leak()


@MODES
def test_chunked_prefill_gives_the_same_tokens_as_unchunked(overlap):
    outs = []
    for chunk in (-1, 7):
        h = Harness(max_running=4, chunked_prefill_size=chunk,
                    disable_overlap_schedule=not overlap)
        for i, n in enumerate([30, 5, 19]):
            h.submit(f"r{i}", n_prompt=n, max_new=6)
        h.run_until_idle()
        outs.append({rid: h.tokens(rid) for rid in ("r0", "r1", "r2")})
        h.assert_no_leak()
    assert outs[0] == outs[1]


def test_max_queued_requests_rejects_with_503_at_once():
    h = Harness(max_running=1, max_queued_requests=2)
    for i in range(4):
        h.submit(f"r{i}", n_prompt=3, max_new=3)
    finals = h.finals()
    assert finals["r2"][0]["type"] == "abort" and finals["r2"][0]["status_code"] == 503
    assert finals["r3"][0]["status_code"] == 503
    h.run_until_idle()
    assert h.finals()["r0"][0]["type"] == "length"
    h.assert_no_leak()


def _req(rid: str, prompt: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=prompt, sampling_params=SamplingParams(),
               stop_token_ids=frozenset())


def test_lpm_puts_the_requests_with_the_longest_cache_hit_first():
    cache = RadixCache(lambda slots: None)
    cache.insert([1, 2, 3, 4, 5, 6], np.arange(1, 7))
    cache.insert([7, 7, 7], np.arange(7, 10))

    def cached_len(r: Req) -> int:
        return cache.match_prefix(r.origin_input_ids[:-1]).length

    q = deque([_req("lonely", [9, 9, 9]), _req("a", [1, 2, 3, 9]), _req("b", [7, 7]),
               _req("c", [1, 2, 3, 4, 5, 8]), _req("d", [7, 7, 7, 8])])
    now = time.time()
    assert [r.rid for r in order_waiting_queue(q, "lpm", cached_len, now)] == ["c", "a", "d", "b", "lonely"]
    assert [r.rid for r in order_waiting_queue(q, "fcfs", cached_len, now)] == ["lonely", "a", "b", "c", "d"]
    assert order_waiting_queue(q, "lpm", None, now) is q  # no cache: fcfs, as SGLang
    big = deque(_req(str(i), [i % 3] * 4) for i in range(200))
    assert order_waiting_queue(big, "lpm", cached_len, now) is big  # fcfs above 128 waiting


def test_lpm_never_passes_over_a_request_for_longer_than_its_bound():
    cache = RadixCache(lambda slots: None)
    cache.insert([1, 2, 3, 4], np.arange(1, 5))

    def cached_len(r: Req) -> int:
        return cache.match_prefix(r.origin_input_ids[:-1]).length

    miss, hit = _req("miss", [9, 9, 9]), _req("hit", [1, 2, 3, 4, 5])
    q = deque([miss, hit])
    now = miss.arrival_time + MAX_PASS_OVER_S / 2
    assert [r.rid for r in order_waiting_queue(q, "lpm", cached_len, now)] == ["hit", "miss"]
    now = miss.arrival_time + MAX_PASS_OVER_S + 0.1  # waited too long: it goes first
    assert [r.rid for r in order_waiting_queue(q, "lpm", cached_len, now)] == ["miss", "hit"]


def test_lpm_admits_a_cache_miss_within_its_bound_under_a_stream_of_hits(monkeypatch):
    """One request admitted at a time, a new cache hit arriving every 0.5 s
    (same prompt: same-length rids) and one miss: the hits would go first
    forever; the miss is admitted once it has waited MAX_PASS_OVER_S."""
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    h = Harness(max_running=1, schedule_policy="lpm", disable_overlap_schedule=True)
    h.submit("h000", n_prompt=30, max_new=1)
    h.submit("m", n_prompt=10, max_new=1)
    for k in range(1, 100):
        clock[0] += 0.5
        h.submit(f"h{k:03d}", n_prompt=30, max_new=1)
        h.sched.step()
        if "m" in h.finals():
            break
    waited = next(e["t"] for e in h.sched.timeline.events if e.get("rid") == "m" and e["event"] == "admitted") - 1000.0
    assert MAX_PASS_OVER_S < waited <= MAX_PASS_OVER_S + 1.0
    assert sum(1 for rid in h.finals() if rid.startswith("h")) >= 8  # hits did go first meanwhile


# the chapter's 8-request example, scaled down 16x: lengths sum to 123, the longest is 64
CHAPTER_LENGTHS = [64, 8, 12, 5, 10, 6, 9, 9]


@MODES
def test_static_batching_utilisation_is_sum_over_batch_times_max(overlap):
    h = Harness(max_running=8, batching="static", disable_overlap_schedule=not overlap)
    for i, n in enumerate(CHAPTER_LENGTHS):
        h.submit(f"r{i}", n_prompt=5, max_new=n, ignore_eos=True)
    sizes = []
    while True:
        b = h.sched.step()
        if b is None:
            break
        sizes.append(len(b))
    assert sizes == [8] * 64  # every step computes all 8 rows: nothing leaves
    assert h.sched.output.utilisation() == sum(CHAPTER_LENGTHS) / (8 * 64)
    assert all(h.finals()[f"r{i}"][1] == n for i, n in enumerate(CHAPTER_LENGTHS))
    h.assert_no_leak()


@MODES
def test_static_batching_admits_nothing_mid_flight(overlap):
    h = Harness(max_running=8, batching="static", disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=5, max_new=10, ignore_eos=True)
    h.sched.step()
    h.submit("late", n_prompt=5, max_new=2, ignore_eos=True)
    kinds = [h.sched.step() for _ in range(9)]
    assert all(b.forward_mode == "decode" and [r.rid for r in b.reqs] == ["a"] for b in kinds)
    b = h.sched.step()
    assert b.forward_mode == "extend" and [r.rid for r in b.reqs] == ["late"]
    h.run_until_idle()
    h.assert_no_leak()


@MODES
def test_continuous_batching_utilisation_is_one(overlap):
    h = Harness(max_running=8, disable_overlap_schedule=not overlap)
    for i, n in enumerate(CHAPTER_LENGTHS):
        h.submit(f"r{i}", n_prompt=5, max_new=n, ignore_eos=True)
    h.run_until_idle()
    assert h.sched.output.utilisation() == 1.0
    h.assert_no_leak()


@MODES
def test_dynamic_batching_waits_for_a_full_batch_or_the_timeout(overlap):
    h = Harness(max_running=3, batching="dynamic", batch_timeout_ms=200,
                disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=3, max_new=2)
    assert h.sched.step() is None  # one waiting, timeout not reached
    h.submit("b", n_prompt=3, max_new=2)
    h.submit("c", n_prompt=3, max_new=2)
    b = h.sched.step()  # three wait: a full batch launches at once
    assert b.forward_mode == "extend" and len(b) == 3
    h.run_until_idle()
    h.submit("d", n_prompt=3, max_new=2)
    assert h.sched.step() is None
    time.sleep(0.25)
    b = h.sched.step()
    assert b.forward_mode == "extend" and [r.rid for r in b.reqs] == ["d"]
    h.run_until_idle()
    h.assert_no_leak()


def test_queue_time_is_reported_per_request():
    h = Harness(max_running=1)
    h.submit("a", n_prompt=3, max_new=5)
    h.submit("b", n_prompt=3, max_new=5)
    h.run_until_idle()
    qt = {m.rids[i]: m.queue_times[i] for m in h.outputs for i in range(len(m.rids))}
    assert qt["b"] >= qt["a"] >= 0.0


def test_out_of_range_values_from_a_peer_abort_one_request_not_the_loop():
    from common.messages import TokenizedGenerateReq

    h = Harness()
    h.sched.process_input_requests([TokenizedGenerateReq(
        rid="bad", input_ids=[5, 6], sampling_params=SamplingParams(top_k=2**40, max_new_tokens=3))])
    assert h.finals()["bad"][0]["type"] == "abort"
    h.submit("ok", n_prompt=3, max_new=3)
    h.run_until_idle()
    assert h.finals()["ok"][0]["type"] == "length"
    h.assert_no_leak()


def test_a_request_moves_waiting_running_retracted_running_finished():
    """Req.state names each stop of the lifecycle docs/architecture.md draws."""
    from scheduler_proc.req import ReqState
    h = Harness(max_running=8, max_total_tokens=200, disable_overlap_schedule=True)
    s = h.sched
    h.submit("a", n_prompt=5, max_new=20)
    req = s.queue.by_rid["a"]
    assert req.state is ReqState.WAITING
    s.step()  # its prefill
    assert req.state is ReqState.RUNNING
    s.step()  # a decode step: it is in the running batch now
    s.decode.retract(req)
    s.decode.running_batch.filter_batch([])
    s.queue.waiting.appendleft(req)
    assert req.state is ReqState.RETRACTED
    h.run_until_idle()
    assert req.state is ReqState.FINISHED and len(req.output_ids) == 20
    h.assert_no_leak()
