"""SIGTERM stops a real server gracefully: no new requests are accepted, the
ones in flight finish if they can within --shutdown-timeout, the rest are
aborted with a finish reason that says so, and launch.py exits 0 with every
process and socket file gone."""

from __future__ import annotations

import os
import signal
import time

import requests

from tests.e2e.server_process import ServerProcess
from tests.reliability.inflight import (UNBOUNDED_POOL, UNBOUNDED_TOKENS, InFlight, health_code,
                                        long_body)
from tests.reliability.server_probe import scheduler_state, stopped_cleanly

SHUTDOWN_TIMEOUT_S = 8.0
SHORT_TOKENS = 3


def test_sigterm_drains_then_aborts_what_is_left() -> None:
    srv = ServerProcess("--max-running-requests", "4", "--max-total-tokens", UNBOUNDED_POOL,
                        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        keep_alive = requests.Session()
        assert keep_alive.get(srv.url + "/health", timeout=10).status_code == 200

        load = InFlight(srv.url)
        load.add("long-stream", long_body("Tell me a story about a dragon.", UNBOUNDED_TOKENS, stream=True))
        assert load.started.wait(60), "the first request never produced a token"
        load.add("long-plain", long_body("Write a poem about rain.", UNBOUNDED_TOKENS, stream=False))
        load.add("short-plain", long_body("Describe the ocean.", SHORT_TOKENS, stream=False))
        load.add("short-stream", long_body("Count to ten.", SHORT_TOKENS, stream=True))
        deadline = time.monotonic() + 30  # all four running (or a short one done already)
        while scheduler_state(srv)["num_running_reqs"] < 4 and not any(f.done() for f in load.futures):
            assert time.monotonic() < deadline, "the requests never all ran"
            time.sleep(0.02)

        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while health_code(srv.url) is not None:  # the listening socket closes
            assert time.monotonic() - t0 < 3.0, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        # a connection opened before keeps working, but only to hear "no"
        refused = keep_alive.get(srv.url + "/health", timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]

        assert stopped_cleanly(srv, timeout=SHUTDOWN_TIMEOUT_S + 20) == 0
        ended = {e.name: e for e in load.results()}
        for name in ("short-plain", "short-stream"):  # finished normally
            e = ended[name]
            assert e.status == 200 and e.transport_error is None, e
            assert e.finish_reason == {"type": "length", "length": SHORT_TOKENS}, e
            assert len(e.final["output_ids"]) == SHORT_TOKENS
        for name in ("long-plain", "long-stream"):  # cut at the timeout, and told why
            e = ended[name]
            assert e.status == 200 and e.transport_error is None, e
            assert e.finish_reason["type"] == "abort", e
            assert "--shutdown-timeout" in e.finish_reason["message"], e
            assert len(e.final["output_ids"]) < UNBOUNDED_TOKENS
            assert SHUTDOWN_TIMEOUT_S - 0.5 <= e.ended_at - t0 <= SHUTDOWN_TIMEOUT_S + 5, \
                f"{name} ended {e.ended_at - t0:.1f} s after SIGTERM"
        assert ended["long-stream"].done  # the stream was closed properly
        assert ended["long-stream"].final["output_ids"], "the stream's tokens so far are kept"
    finally:
        srv.kill()


def test_a_second_sigterm_aborts_what_is_left_at_once() -> None:
    srv = ServerProcess("--max-running-requests", "2", "--max-total-tokens", UNBOUNDED_POOL)  # 30 s
    try:
        load = InFlight(srv.url)
        load.add("long-stream", long_body("Tell me a story about a dragon.", UNBOUNDED_TOKENS, stream=True))
        assert load.started.wait(60), "the first request never produced a token"
        load.add("long-plain", long_body("Write a poem about rain.", UNBOUNDED_TOKENS, stream=False))
        deadline = time.monotonic() + 30
        while scheduler_state(srv)["num_running_reqs"] < 2:
            assert time.monotonic() < deadline, "the requests never both ran"
            time.sleep(0.02)

        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert not any(f.done() for f in load.futures), "the first SIGTERM cut requests short"
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        ended = {e.name: e for e in load.results()}
        for e in ended.values():
            assert e.ended_at - t0 < 5.0, f"{e.name} ended {e.ended_at - t0:.1f} s after"
            assert e.is_error_answer(), e
        assert "asked twice to stop" in ended["long-plain"].final["error"]["message"]
        assert "asked twice to stop" in ended["long-stream"].finish_reason["message"]
        assert stopped_cleanly(srv) == 0
    finally:
        srv.kill()


def test_sigterm_to_the_whole_process_group_still_drains() -> None:
    """`timeout`, `kill -TERM -PGID` and some supervisors signal every process
    of the group: the model process must not die under the requests in flight."""
    srv = ServerProcess("--max-running-requests", "2", "--max-total-tokens", "4096")
    try:
        load = InFlight(srv.url)
        load.add("stream", long_body("Tell me a story about a dragon.", 24, stream=True))
        assert load.started.wait(60), "the request never produced a token"
        load.add("plain", long_body("Write a poem about rain.", 24, stream=False))
        os.killpg(srv.proc.pid, signal.SIGTERM)  # ServerProcess starts launch.py as a group leader
        ended = {e.name: e for e in load.results()}
        for e in ended.values():
            assert e.status == 200 and e.transport_error is None, e
            assert e.finish_reason == {"type": "length", "length": 24}, e
        assert stopped_cleanly(srv) == 0
    finally:
        srv.kill()
