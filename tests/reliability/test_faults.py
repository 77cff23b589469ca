"""Process faults on a real server: a child killed with SIGKILL, or launch.py
itself. Nothing may hang: every request in flight or queued gets an error
answer within 5 s, /health stops answering 200, no process is left behind
and the socket folder is removed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.server_process import ServerProcess, pid_alive
from tests.reliability.inflight import (UNBOUNDED_POOL, UNBOUNDED_TOKENS, Ended, InFlight, health_code,
                                        long_body)
from tests.reliability.server_probe import (child_pid, ipc_dir, scheduler_state, stopped_cleanly,
                                            wait_gone)

FLAGS = ("--max-running-requests", "2", "--max-total-tokens", UNBOUNDED_POOL)
ANSWER_WITHIN_S = 5.0


def start_two_running_two_queued(srv: ServerProcess) -> InFlight:
    """Two running rows (one streaming, one not) and two queued requests,
    all far from done."""
    load = InFlight(srv.url)
    load.add("running-stream", long_body("Tell me a story about a dragon.", UNBOUNDED_TOKENS, stream=True))
    assert load.started.wait(60), "the first request never produced a token"
    load.add("running-plain", long_body("Write a poem about rain.", UNBOUNDED_TOKENS, stream=False))
    load.add("queued-stream", long_body("List every prime number.", UNBOUNDED_TOKENS, stream=True))
    load.add("queued-plain", long_body("Describe the ocean.", UNBOUNDED_TOKENS, stream=False))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = scheduler_state(srv)
        if state["num_running_reqs"] == 2 and state["num_waiting_reqs"] == 2:
            return load
        time.sleep(0.05)
    raise AssertionError(f"never had 2 running and 2 queued: {state}")


def assert_all_answered_with_errors(ended: list[Ended], since: float) -> None:
    for e in ended:
        assert e.is_error_answer(), f"{e.name}: not a clean error answer: {e}"
        assert e.ended_at - since <= ANSWER_WITHIN_S, \
            f"{e.name} answered {e.ended_at - since:.1f} s after the fault"


def assert_health_stops(url: str, since: float) -> None:
    while health_code(url) == 200:
        assert time.monotonic() - since <= ANSWER_WITHIN_S, "/health still answers 200"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["model_proc", "scheduler_proc"])
def test_dead_engine_process_fails_every_request_and_the_server(victim: str) -> None:
    srv = ServerProcess(*FLAGS)
    try:
        load = start_two_running_two_queued(srv)
        os.kill(child_pid(srv, victim), signal.SIGKILL)
        t0 = time.monotonic()
        assert_health_stops(srv.url, t0)
        ended = load.results()
        assert_all_answered_with_errors(ended, t0)
        plain = next(e for e in ended if e.name == "running-plain")
        assert plain.status == 503 and "process" in plain.final["error"]["message"], plain
        assert stopped_cleanly(srv) != 0
    finally:
        srv.kill()


def test_dead_tokenizer_process_takes_the_others_down_by_themselves() -> None:
    """launch.py is stopped (SIGSTOP) first, so the scheduler and the model
    must notice the dead peer on their own."""
    srv = ServerProcess(*FLAGS)
    try:
        others = [child_pid(srv, "scheduler_proc"), child_pid(srv, "model_proc")]
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            os.kill(child_pid(srv, "tokenizer_proc"), signal.SIGKILL)
            assert not wait_gone(others, ANSWER_WITHIN_S), "scheduler/model outlived the tokenizer"
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert stopped_cleanly(srv) != 0
    finally:
        srv.kill()


def test_killed_launcher_leaves_no_process_and_no_hung_client() -> None:
    srv = ServerProcess(*FLAGS)
    try:
        load = start_two_running_two_queued(srv)
        folder = ipc_dir(srv)
        os.kill(srv.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert not wait_gone(srv.child_pids, ANSWER_WITHIN_S), \
            "children outlived a SIGKILLed launch.py"
        assert_all_answered_with_errors(load.results(), t0)
        assert health_code(srv.url) is None
        assert not os.path.exists(folder), "the ZMQ socket folder was left behind"
    finally:
        srv.kill()
        for pid in srv.child_pids:  # never leak a process into the rest of the suite
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
