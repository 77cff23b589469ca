"""Scheduling control on the real server, as a user tries it: a high-priority
request preempts a running low-priority one and is answered while the other
waits (it resumes afterwards); a request stuck in the queue past
--queue-timeout-ms gets a 503; a deadline ends a request with its text so far."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

from tests.e2e.server_process import ServerProcess
from tests.reliability.inflight import UNBOUNDED_TOKENS


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-running-requests", "1", "--enable-priority-scheduling", "--priority-preemption",
                        "--queue-timeout-ms", "3000")
    # the first steps of a fresh process are slow (kernels are built): out of the timed part
    assert generate(srv, {"text": "Warm up", "sampling_params": {"max_new_tokens": 16}}).status_code == 200
    yield srv
    srv.kill()


def generate(server, body, timeout=120):
    return requests.post(server.url + "/generate", json=body, timeout=timeout)


def long_running(server, rid: str, priority: int) -> concurrent.futures.Future:
    """A request that would run for minutes (the test aborts it), once it runs."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(generate, server, {
        "text": "Count to a million:", "rid": rid, "priority": priority,
        "sampling_params": {"max_new_tokens": UNBOUNDED_TOKENS, "ignore_eos": True}})
    pool.shutdown(wait=False)
    wait_until_running(server, 1)
    return future


def wait_until_running(server, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = requests.get(server.url + "/get_server_info", timeout=10).json()["scheduler"]
        if state["num_running_reqs"] == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"never {n} running")


def abort(server, rid: str) -> None:
    assert requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200


def test_a_high_priority_request_preempts_a_running_low_priority_one(server):
    low = long_running(server, "low-1", priority=0)
    high = generate(server, {"text": "Hello", "priority": 10, "sampling_params": {"max_new_tokens": 8}})
    # one row: it could only run by taking the low one's (which is unbounded)
    assert high.status_code == 200 and high.json()["meta_info"]["completion_tokens"] <= 8
    assert not low.done()
    wait_until_running(server, 1)  # the low one resumed
    abort(server, "low-1")
    low_meta = low.result(timeout=60).json()["meta_info"]
    assert low_meta["finish_reason"]["type"] == "abort"
    assert low_meta["num_retractions"] >= 1  # it was preempted, then resumed


def test_equal_priority_waits_and_a_queue_timeout_is_a_503(server):
    running = long_running(server, "running-1", priority=0)
    start = time.monotonic()
    queued = generate(server, {"text": "Hi", "priority": 0, "sampling_params": {"max_new_tokens": 4}})
    assert queued.status_code == 503 and "request queue timeout" in queued.json()["error"]["message"], queued.text
    assert time.monotonic() - start >= 2.9  # not before --queue-timeout-ms
    assert not running.done()  # it did not take the row: it timed out waiting for it
    abort(server, "running-1")
    assert running.result(timeout=60).status_code == 200
