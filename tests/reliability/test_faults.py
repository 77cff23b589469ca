"""Process faults on a real server: a child killed with SIGKILL, or launch.py
itself. Nothing may hang: every request in flight or queued gets an error
answer within 5 s, /health stops answering 200, no process is left behind
and the socket folder is removed. And a child alive but hung (SIGSTOP):
/health says so, deadlines are kept, the watchdog ends the server as a
crash does."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.e2e.server_process import ServerProcess, pid_alive
from tests.reliability.inflight import (UNBOUNDED_POOL, UNBOUNDED_TOKENS, Ended, InFlight, health_code,
                                        long_body)
from tests.reliability.server_probe import (child_pid, ipc_dir, scheduler_state, shut_down, stopped_cleanly,
                                            wait_gone, wait_idle)

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


# ---- a hung engine: a process stopped (SIGSTOP), alive but not answering ----------------

HEALTH_BOUND_S = 2.0  # --health-check-timeout in these tests
WATCHDOG_S = 4.0  # --watchdog-timeout in these tests
DEADLINE_S = 4.0  # the deadline requests' `timeout`


def with_timeout(body: dict, timeout_s: float) -> dict:
    return {**body, "timeout": timeout_s}


def wait_health(url: str, code: int, within: float) -> float:
    """Seconds until /health answers `code`; fails after `within`."""
    t0 = time.monotonic()
    while health_code(url) != code:
        assert time.monotonic() - t0 <= within, f"/health did not answer {code} within {within} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # gone with the server: nothing to resume


@pytest.mark.parametrize("victim", ["model_proc", "scheduler_proc"])
def test_a_stopped_engine_process_fails_health_keeps_deadlines_and_resumes_harmlessly(victim: str) -> None:
    """SIGSTOP on the model or the scheduler with requests in flight (no
    watchdog: the default 300 s): /health turns 503 within its bound, each
    request with a deadline gets its abort at the deadline (the front end
    keeps it), and after SIGCONT the server serves again and nothing is
    left held."""
    srv = ServerProcess(*FLAGS, "--health-check-timeout", str(HEALTH_BOUND_S))
    pid = child_pid(srv, victim)
    try:
        load = InFlight(srv.url)
        load.add("running-stream", long_body("Tell me a story about a dragon.", UNBOUNDED_TOKENS, stream=True))
        assert load.started.wait(60), "the first request never produced a token"
        submitted = time.monotonic()
        for name, stream in (("deadline-plain", False), ("deadline-stream", True)):
            load.add(name, with_timeout(long_body("Write a poem.", UNBOUNDED_TOKENS, stream=stream), DEADLINE_S))
        time.sleep(0.5)  # both are in the scheduler: one runs, one waits
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            took = wait_health(srv.url, 503, HEALTH_BOUND_S + 2.0)
            print(f"/health 503 {took:.2f} s after SIGSTOP of the {victim} (bound {HEALTH_BOUND_S:g} s)")
            ended = {e.name: e for e in [f.result(timeout=DEADLINE_S + 10) for f in load.futures[1:]]}
            for name, e in ended.items():
                at = e.ended_at - submitted
                print(f"{name} answered {at:.2f} s after it was sent (timeout {DEADLINE_S:g} s)")
                assert e.status == 200 and e.finish_reason == {"type": "abort", "message": "deadline exceeded"}, e
                assert DEADLINE_S - 0.5 <= at <= DEADLINE_S + 1.5, f"{name} answered at {at:.2f} s"
            assert ended["deadline-stream"].done
            assert time.monotonic() - stopped < 10  # still stopped meanwhile
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_health(srv.url, 200, 10.0)
        short = requests.post(srv.url + "/generate", timeout=60, json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        assert short.status_code == 200 and short.json()["meta_info"]["completion_tokens"] == 4
        requests.post(srv.url + "/abort_request", json={"abort_all": True}, timeout=10)
        running = load.results()[0]
        assert running.is_error_answer() or running.finish_reason["type"] == "abort", running
        wait_idle(srv)
        shut_down(srv)
        assert srv.proc.returncode == 0
    finally:
        resume(pid)
        srv.kill()


@pytest.mark.parametrize("victim", ["model_proc", "scheduler_proc"])
def test_the_watchdog_ends_a_server_whose_engine_hangs(victim: str) -> None:
    """SIGSTOP on the model or the scheduler with --watchdog-timeout 4: every
    client gets an error answer naming the watchdog, launch.py exits 1 with
    nothing left behind; a SIGCONT afterwards changes nothing."""
    srv = ServerProcess(*FLAGS, "--watchdog-timeout", str(WATCHDOG_S))
    pid = child_pid(srv, victim)
    try:
        load = start_two_running_two_queued(srv)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        ended = load.results()
        for e in ended:
            assert e.is_error_answer(), f"{e.name}: not a clean error answer: {e}"
            took = e.ended_at - t0
            assert WATCHDOG_S - 0.5 <= took <= WATCHDOG_S + 3.0, f"{e.name} answered {took:.1f} s after the stop"
        print(f"every client answered {max(e.ended_at for e in ended) - t0:.2f} s after SIGSTOP of the {victim}")
        plain = next(e for e in ended if e.name == "running-plain")
        assert plain.status == 503 and "watchdog" in plain.final["error"]["message"], plain
        assert stopped_cleanly(srv) == 1
        print(f"launch.py exited 1 {time.monotonic() - t0:.2f} s after the stop")
        resume(pid)
        assert not pid_alive(pid)
    finally:
        resume(pid)
        srv.kill()
