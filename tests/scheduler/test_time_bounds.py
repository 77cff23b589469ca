"""Time bounds (fake model, a fake clock): a request past its deadline ends as
an abort "deadline exceeded" wherever it is (waiting, mid-chunked-prefill,
mid-decode) and every slot it held is freed; --request-timeout-s is the
default deadline; a request still waiting for its first prefill after
--queue-timeout-ms is refused with a 503; others in flight are untouched.
And the waiting queue is bounded even without --max-queued-requests."""

from __future__ import annotations

import time

import pytest

from common.messages import SamplingParams, TokenizedGenerateReq
from scheduler_proc.queries import scheduler_state
from tests.scheduler.test_scheduler import MODES, Harness
from tokenizer_proc.finish_json import finish_json

DEADLINE = {"type": "abort", "message": "deadline exceeded"}
QUEUE_TIMEOUT = {"type": "abort", "message": "request queue timeout", "status_code": 503}


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    return now


def submit(h: Harness, rid: str, n_prompt: int, max_new: int, timeout_s: float | None = None) -> None:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    h.sched.process_input_requests([TokenizedGenerateReq(
        rid=rid, input_ids=[(i * 13 + len(rid)) % 900 + 10 for i in range(n_prompt)], sampling_params=sp,
        arrival_time=time.time(), timeout_s=timeout_s)])


@MODES
def test_a_deadline_mid_decode_ends_the_request_and_frees_its_kv(clock, overlap):
    h = Harness(max_running=4, disable_overlap_schedule=not overlap)
    submit(h, "timed", 20, 480, timeout_s=2.0)
    submit(h, "other", 20, 30)
    for _ in range(10):
        h.sched.step()
    clock[0] += 2.5
    h.run_until_idle()
    finals = h.finals()
    assert finals["timed"][0] == DEADLINE and 5 <= finals["timed"][1] < 480  # its tokens so far
    assert finals["other"][0] == {"type": "length", "length": 30}
    h.assert_no_leak()


@MODES
def test_a_deadline_mid_chunked_prefill_frees_every_slot(clock, overlap):
    h = Harness(max_running=4, chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    submit(h, "long", 200, 10, timeout_s=1.0)
    h.sched.step()
    assert h.sched.prefill.chunked_req is not None and h.sched.prefill.chunked_req.rid == "long"
    clock[0] += 1.5
    submit(h, "next", 10, 5)
    h.run_until_idle()
    finals = h.finals()
    assert finals["long"] == (DEADLINE, 0)
    assert finals["next"][0] == {"type": "length", "length": 5}
    h.assert_no_leak()


def test_the_server_default_deadline_applies_unless_a_request_sets_its_own(clock):
    h = Harness(max_running=1, request_timeout_s=5.0, disable_overlap_schedule=True)
    submit(h, "default", 10, 480)  # ends at 5 s
    submit(h, "own", 10, 3, timeout_s=60.0)  # waits behind it, then runs to its end
    for _ in range(5):
        h.sched.step()
    clock[0] += 5.1
    h.run_until_idle()
    finals = h.finals()
    assert finals["default"][0] == DEADLINE
    assert finals["own"][0] == {"type": "length", "length": 3}
    h.assert_no_leak()


def test_a_deadline_while_waiting_is_an_abort_not_a_refusal(clock):
    h = Harness(max_running=1, disable_overlap_schedule=True)
    submit(h, "busy", 10, 480, timeout_s=30.0)
    submit(h, "waiting", 10, 5, timeout_s=1.0)
    h.sched.step()
    clock[0] += 1.5
    h.sched.step()
    assert h.finals()["waiting"] == (DEADLINE, 0)
    assert "waiting" not in h.sched.queue.by_rid and len(h.sched.queue.waiting) == 0
    clock[0] += 30
    h.run_until_idle()
    h.assert_no_leak()


@MODES
def test_a_request_queued_past_the_queue_timeout_gets_a_503_and_admitted_ones_are_untouched(clock, overlap):
    h = Harness(max_running=1, queue_timeout_ms=200, disable_overlap_schedule=not overlap)
    submit(h, "running", 10, 40)
    h.sched.step()
    submit(h, "queued", 10, 5)
    clock[0] += 0.1
    h.sched.step()
    assert "queued" not in h.finals()
    clock[0] += 0.15  # the running request is past 200 ms too: it was admitted, so it runs on
    h.run_until_idle()
    finals = h.finals()
    assert finals["queued"] == (QUEUE_TIMEOUT, 0)
    assert finals["running"][0] == {"type": "length", "length": 40}
    h.assert_no_leak()


def test_a_reused_rid_does_not_inherit_the_old_requests_deadline(clock):
    h = Harness(max_running=2, disable_overlap_schedule=True)
    submit(h, "r", 10, 3, timeout_s=1.0)
    h.run_until_idle()
    submit(h, "r", 10, 50)  # the same rid, no deadline
    clock[0] += 2.0
    h.run_until_idle()
    assert [finish_json(f) for m in h.outputs for f in m.finished_reasons if f] == [
        {"type": "length", "length": 3}, {"type": "length", "length": 50}]
    h.assert_no_leak()


def test_the_queue_is_bounded_by_default(clock):
    from scheduler_proc.scheduler import default_queue_limit

    h = Harness(max_running=2, max_total_tokens=64 * 200, disable_overlap_schedule=True)
    limit = default_queue_limit(2, 64 * 200)
    assert limit == 200 and scheduler_state(h.sched)["max_queued_requests"] == 200
    for i in range(limit + 5):
        submit(h, f"r{i}", 4, 2)
    refused = [rid for rid, (reason, _) in h.finals().items() if reason.get("status_code") == 503]
    assert len(refused) == 5 and "queue is full" in h.finals()[refused[0]][0]["message"]
    h.run_until_idle()
    h.assert_no_leak()
