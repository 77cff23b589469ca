"""Priority scheduling (fake model): with --enable-priority-scheduling waiting
requests are admitted by priority, then arrival; with --priority-preemption a
blocked request retracts running ones of strictly lower priority, which
resume and finish with the output they would have had; aging bounds how long
any request is passed over."""

from __future__ import annotations

import time

import pytest

from common.messages import SamplingParams, TokenizedGenerateReq
from scheduler_proc.policy import MAX_PASS_OVER_S
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


def test_a_low_priority_request_is_not_passed_over_for_longer_than_the_aging_bound(monkeypatch):
    """One request admitted at a time, a new high-priority request every 0.5 s,
    and one low-priority request: the high ones would go first forever; the
    low one is admitted once it has waited MAX_PASS_OVER_S."""
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    h = Harness(max_running=1, enable_priority_scheduling=True, disable_overlap_schedule=True)
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
    assert MAX_PASS_OVER_S < waited <= MAX_PASS_OVER_S + 1.0
    assert sum(1 for rid in h.finals() if rid.startswith("h")) >= 8  # the high ones did go first meanwhile


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
