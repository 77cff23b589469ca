"""Priority scheduling (fake model): with --enable-priority-scheduling waiting
requests are admitted by priority, then arrival; with --priority-preemption a
blocked request retracts running ones of strictly lower priority, which
resume and finish with the output they would have had; aging
(--priority-aging-s) raises a waiting request's priority a level per step
waited, which bounds how long it is passed over without undoing priorities."""

from __future__ import annotations

import time
from collections import deque

import pytest

from common.messages import SamplingParams, TokenizedGenerateReq
from scheduler_proc.policy import MAX_PASS_OVER_S, order_waiting_queue
from scheduler_proc.req import Req
from tests.scheduler.fake_model import next_token
from tests.scheduler.test_scheduler import MODES, Harness


def submit(h: Harness, rid: str, n_prompt: int, max_new: int, priority: int = 0) -> list[int]:
    prompt = [(i * 13 + len(rid) * 7 + ord(rid[-1])) % 900 + 10 for i in range(n_prompt)]
    h.sched.process_input_requests([TokenizedGenerateReq(
        rid=rid, input_ids=prompt, arrival_time=time.time(), priority=priority,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))])
    return prompt


def expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def admission_order(h: Harness) -> list[str]:
    return [e["rid"] for e in h.sched.timeline.events if e.get("event") == "admitted"]


@pytest.mark.parametrize("enabled", [True, False])
def test_waiting_requests_are_admitted_by_priority_then_arrival(enabled):
    h = Harness(max_running=1, enable_priority_scheduling=enabled, disable_overlap_schedule=True)
    submit(h, "first", 8, 3)
    h.sched.step()  # "first" runs; the rest wait
    for rid, prio in [("low-a", 0), ("high-a", 5), ("mid", 2), ("high-b", 5), ("low-b", -1)]:
        submit(h, rid, 8, 2, prio)
    h.run_until_idle()
    order = admission_order(h)
    if enabled:
        assert order == ["first", "high-a", "high-b", "mid", "low-a", "low-b"]
    else:
        assert order == ["first", "low-a", "high-a", "mid", "high-b", "low-b"]  # priority ignored
    h.assert_no_leak()


def test_low_priority_values_first_flips_the_order():
    h = Harness(max_running=1, enable_priority_scheduling=True, schedule_low_priority_values_first=True,
                disable_overlap_schedule=True)
    submit(h, "first", 8, 3)
    h.sched.step()
    for rid, prio in [("p5", 5), ("p1", 1), ("p3", 3)]:
        submit(h, rid, 8, 2, prio)
    h.run_until_idle()
    assert admission_order(h) == ["first", "p1", "p3", "p5"]


@MODES
def test_preemption_retracts_lower_priority_only_and_they_resume_with_the_same_output(overlap):
    h = Harness(max_running=2, enable_priority_scheduling=True, priority_preemption=True,
                disable_overlap_schedule=not overlap)
    prompts = {"low": submit(h, "low", 10, 60, priority=0), "peer": submit(h, "peer", 12, 60, priority=3)}
    for _ in range(5):
        h.sched.step()
    prompts["same"] = submit(h, "same", 9, 5, priority=3)  # equal to "peer", above "low"
    prompts["urgent"] = submit(h, "urgent", 11, 5, priority=9)
    h.run_until_idle()
    finals = h.finals()
    retracted = {e["rid"] for e in h.sched.timeline.events if e.get("event") == "retracted"}
    # "urgent" takes the row of "low" (the lowest); "same" may not take the
    # row of "peer" (equal priority) and waits
    assert retracted == {"low"}
    order = admission_order(h)
    assert order.index("urgent") < order.index("same")
    for rid, prompt in prompts.items():
        n = 60 if rid in ("low", "peer") else 5
        assert finals[rid][0] == {"type": "length", "length": n}
        assert h.tokens(rid) == expected(prompt, n), rid
    h.assert_no_leak()


def test_no_preemption_without_the_flag_or_among_equals():
    for flags, newcomer_priority in [({}, 9), ({"priority_preemption": True}, 0)]:
        h = Harness(max_running=1, enable_priority_scheduling=True, disable_overlap_schedule=True, **flags)
        submit(h, "running", 10, 30, priority=0)
        h.sched.step()
        submit(h, "newcomer", 10, 3, priority=newcomer_priority)
        h.run_until_idle()
        assert not [e for e in h.sched.timeline.events if e.get("event") == "retracted"]
        assert admission_order(h) == ["running", "newcomer"]


def test_preemption_needs_priority_scheduling():
    with pytest.raises(ValueError, match="--enable-priority-scheduling"):
        Harness(priority_preemption=True)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    return now


def finish_order(h: Harness) -> list[str]:
    return [rid for m in h.outputs for rid, reason in zip(m.rids, m.finished_reasons) if reason is not None]


@pytest.mark.parametrize("aging_s", [1.0, 2.0])
def test_a_low_priority_request_is_not_passed_over_for_longer_than_the_aging_bound(clock, aging_s):
    """One request admitted at a time, a new request of priority 5 every 0.5 s,
    and one of priority 0: without aging the high ones would go first
    forever; with --priority-aging-s the low one gains a level per aging_s
    seconds waited and is admitted once it has waited 5 levels' worth."""
    h = Harness(max_running=1, enable_priority_scheduling=True, disable_overlap_schedule=True,
                priority_aging_s=aging_s)
    submit(h, "h000", 10, 1, priority=5)
    submit(h, "low", 10, 1, priority=0)
    for k in range(1, 100):
        clock[0] += 0.5
        submit(h, f"h{k:03d}", 10, 1, priority=5)
        h.sched.step()
        if "low" in h.finals():
            break
    waited = next(e["t"] for e in h.sched.timeline.events
                  if e.get("rid") == "low" and e["event"] == "admitted") - 1000.0
    bound = 5 * aging_s  # the priority gap, in aging steps
    assert bound <= waited <= bound + 1.0
    assert sum(1 for rid in h.finals() if rid.startswith("h")) >= 2 * bound - 2  # the high ones did go first meanwhile


def test_without_aging_a_stream_of_higher_priorities_keeps_a_low_one_waiting(clock):
    h = Harness(max_running=1, enable_priority_scheduling=True, disable_overlap_schedule=True,
                priority_aging_s=0)
    submit(h, "low", 10, 1, priority=0)
    submit(h, "h000", 10, 1, priority=5)
    for k in range(1, 60):  # 30 s of a new high-priority request every 0.5 s
        clock[0] += 0.5
        submit(h, f"h{k:03d}", 10, 1, priority=5)
        h.sched.step()
    assert "low" not in h.finals()
    h.run_until_idle()
    assert finish_order(h)[-1] == "low"


def test_a_high_priority_request_goes_ahead_of_low_ones_queued_longer_than_5_s(clock):
    """The issue's reproduction: one long request on --max-running-requests 1,
    three priority-0 requests, then a priority-10 one, the queue more than
    5 s deep. With the default aging (a level per 5 s) the priority-0
    requests have gained one level, not ten: the priority-10 one goes first."""
    h = Harness(max_running=1, enable_priority_scheduling=True, disable_overlap_schedule=True)
    submit(h, "long", 10, 60)
    h.sched.step()  # "long" runs; the rest wait
    for rid in ("p0-a", "p0-b", "p0-c"):
        submit(h, rid, 10, 3, priority=0)
    for _ in range(40):  # 8 s of the long request decoding
        clock[0] += 0.2
        h.sched.step()
    submit(h, "p10", 10, 3, priority=10)
    for _ in range(30):
        clock[0] += 0.2
        h.sched.step()
    h.run_until_idle()
    order = finish_order(h)
    assert order[0] == "long" and order[1] == "p10", order
    assert order[2:] == ["p0-a", "p0-b", "p0-c"]
    h.assert_no_leak()


def test_aging_gives_one_level_per_aging_step_and_lpm_overdue_never_beats_a_priority():
    now = 1000.0

    def req(rid: str, priority: int, waited: float) -> Req:
        r = Req(rid=rid, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(),
                stop_token_ids=frozenset(), priority=priority)
        r.waiting_since = now - waited
        return r

    def order(q: deque[Req], **kw) -> list[str]:
        return [r.rid for r in order_waiting_queue(q, kw.pop("policy", "fcfs"), kw.pop("match_len", None),
                                                   now, by_priority=True, **kw)]

    # a gap of 3 levels at 5 s a level: the low one passes only after 15 s
    assert order(deque([req("low", 0, 14.9), req("high", 3, 0.0)]), aging_s=5.0) == ["high", "low"]
    assert order(deque([req("low", 0, 15.0), req("high", 3, 0.0)]), aging_s=5.0) == ["low", "high"]
    assert order(deque([req("low", 0, 1e6), req("high", 3, 0.0)]), aging_s=None) == ["high", "low"]
    # smaller values first: the same rule, mirrored
    assert order(deque([req("p9", 9, 14.9), req("p6", 6, 0.0)]), aging_s=5.0, low_priority_first=True) \
        == ["p6", "p9"]
    # lpm's own bound (MAX_PASS_OVER_S) orders equals only: an overdue miss
    # goes ahead of a hit of its own priority, never of a higher one
    q = deque([req("miss", 0, MAX_PASS_OVER_S + 1), req("hit", 0, 0.0), req("high", 1, 0.0)])
    hits = {"miss": 0, "hit": 3, "high": 0}
    assert order(q, policy="lpm", match_len=lambda r: hits[r.rid], aging_s=None) == ["high", "miss", "hit"]


def test_with_low_values_first_preemption_takes_the_largest_value():
    h = Harness(max_running=2, enable_priority_scheduling=True, priority_preemption=True,
                schedule_low_priority_values_first=True, disable_overlap_schedule=True)
    submit(h, "p1", 10, 40, priority=1)
    submit(h, "p7", 10, 40, priority=7)
    for _ in range(4):
        h.sched.step()
    submit(h, "p0", 10, 3, priority=0)
    h.run_until_idle()
    assert [e["rid"] for e in h.sched.timeline.events if e.get("event") == "retracted"] == ["p7"]
    h.assert_no_leak()
