"""Looking at a running server from the outside: its scheduler's state, its
processes' memory, whether it is idle with nothing leaked."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import Any

import requests

from tests.e2e.server_process import ServerProcess, cmdline, pid_alive

IDLE_TIMEOUT_S = 30.0


def scheduler_state(srv: ServerProcess) -> dict[str, Any]:
    info = requests.get(srv.url + "/get_server_info", timeout=30).json()
    sched = info["scheduler"]
    assert sched is not None, "the scheduler did not answer /get_server_info"
    return {**sched, "requests_in_flight": info.get("requests_in_flight", 0)}


def leaks(state: dict[str, Any]) -> list[str]:
    """What is still held in an idle server: running or waiting requests, KV
    slots (held by a request, or locked in the prefix cache: cached and
    evictable slots are not held), table rows, broken KV accounts, tracked
    requests."""
    found = []
    if state["num_running_reqs"] or state["num_waiting_reqs"]:
        found.append(f"{state['num_running_reqs']} running, {state['num_waiting_reqs']} waiting")
    if state["held_kv_slots"] or state["protected_kv_slots"]:
        found.append(f"{state['held_kv_slots']} KV slots held, {state['protected_kv_slots']} locked")
    if state["free_kv_slots"] + state["evictable_kv_slots"] != state["total_kv_slots"]:
        found.append(f"free {state['free_kv_slots']} + evictable {state['evictable_kv_slots']} "
                     f"!= {state['total_kv_slots']} KV slots")
    if state["invariant_error"]:
        found.append(f"KV accounts: {state['invariant_error']}")
    if state["free_req_rows"] != state["total_req_rows"]:
        found.append(f"{state['total_req_rows']} req_to_token rows, {state['free_req_rows']} free")
    if state.get("requests_in_flight"):
        found.append(f"{state['requests_in_flight']} requests still tracked by the tokenizer process")
    return found


def wait_idle(srv: ServerProcess, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Polls until nothing runs, waits or is held; asserts it gets there."""
    deadline = time.monotonic() + timeout
    while True:
        state = scheduler_state(srv)
        found = leaks(state)
        if not found:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout:g} s: {'; '.join(found)} ({state})")
        time.sleep(0.1)


def child_pid(srv: ServerProcess, module: str) -> int:
    """The pid of the child running `python -m <module>`."""
    return next(p for p in srv.child_pids if cmdline(p).split()[2:3] == [module])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))


def rss_of_processes(srv: ServerProcess) -> dict[str, int]:
    """KiB resident per process of the server (launch.py included)."""
    pids = {"launch": srv.proc.pid, **{m: child_pid(srv, m) for m in
                                        ("tokenizer_proc", "scheduler_proc", "model_proc")}}
    return {name: rss_kib(pid) for name, pid in pids.items()}


def ipc_dir(srv: ServerProcess) -> str:
    return re.search(r"ZMQ ipc sockets in (\S+)", "".join(srv.log)).group(1)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits up to `timeout` s for every pid to be dead (a zombie counts as
    dead); returns the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def stopped_cleanly(srv: ServerProcess, timeout: float = 30.0) -> int:
    """Waits for launch.py to exit; asserts no child is left and the socket
    folder is gone; returns its exit code."""
    code = srv.proc.wait(timeout=timeout)
    assert not wait_gone(srv.child_pids, 5.0), "a child outlived launch.py"
    assert not os.path.exists(ipc_dir(srv)), "the ZMQ socket folder was left behind"
    return code


def shut_down(srv: ServerProcess) -> None:
    """Stops a server the way an operator would (SIGTERM: nothing is in flight,
    so it is quick), so that launch.py removes its socket folder; SIGKILLs the
    whole group if that fails."""
    if srv.proc.poll() is None:
        try:
            srv.stop(signal.SIGTERM, timeout=30)
        except subprocess.TimeoutExpired:
            pass
    srv.kill()
