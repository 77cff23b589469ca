"""Operations routes: /health and /health_generate, model and server info, /abort_request;
the front end's own bounds on a silent engine (its deadlines, its watchdog)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from common.messages import SchedulerHeartbeat
from tests.tokenizer_proc.server_harness import Server, get, open_raw, post, read_until, sse_events, wait_until
from tokenizer_proc.http_server import MANAGER
from tokenizer_proc.tokenizer import load_tokenizer


def test_health_generate_ok(server: Server) -> None:
    status, _, raw = get(server, "/health_generate")
    assert status == 200 and json.loads(raw) == {}
    req = server.fake.requests()[-1]
    assert req.rid.startswith("HEALTH_CHECK_") and req.sampling_params.max_new_tokens == 1
    wait_until(lambda: not server.in_flight())


def test_health_generate_503_when_engine_is_stuck(server: Server) -> None:
    server.fake.silent = True
    try:
        t0 = time.monotonic()
        status, _, raw = get(server, "/health_generate")
        elapsed = time.monotonic() - t0
    finally:
        server.fake.silent = False
    assert status == 503 and 0.4 < elapsed < 3  # the fixture's timeout is 0.5 s
    err = json.loads(raw)["error"]
    assert err["code"] == 503 and "did not answer" in err["message"]
    assert not server.in_flight()  # the stuck request is not kept forever
    assert get(server, "/health_generate")[0] == 200  # back to normal


def test_get_model_info(server: Server) -> None:
    status, _, raw = get(server, "/get_model_info")
    info = json.loads(raw)
    assert status == 200
    assert {"model_path", "tokenizer_path", "served_model_name", "context_len", "vocab_size",
            "max_total_tokens", "eos_token_ids", "is_generation"} <= set(info)
    assert info["context_len"] == server.info.context_len and info["served_model_name"] == "test"


def test_get_server_info(server: Server) -> None:
    status, _, raw = get(server, "/get_server_info")
    info = json.loads(raw)
    assert status == 200
    assert info["max_request_bytes"] == server.args.max_request_bytes
    assert info["max_running_requests"] == server.args.max_running_requests
    assert info["model_info"]["context_len"] == server.info.context_len
    assert info["api_key"] == ""  # none set here; a set one is redacted (test_security)
    assert info["scheduler"]["num_waiting_reqs"] == 2 and "requests_in_flight" in info


def test_abort_request_by_rid(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "stream": True, "rid": "hang-by-rid"})
    read_until(sock, b"data: ")
    status, _, raw = post(server, {"rid": "hang-by-rid"}, "/abort_request")
    assert status == 200 and json.loads(raw) == {"aborted": ["hang-by-rid"]}
    body = read_until(sock, b"data: [DONE]\n\n")  # the stream ends, with an abort reason
    sock.close()
    assert b'"finish_reason":{"type":"abort"' in body
    assert "hang-by-rid" in server.fake.aborts()
    wait_until(lambda: "hang-by-rid" not in server.in_flight())


def test_abort_request_by_group_rid(server: Server) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, server, {"text": "hi", "rid": "hang-grp", "sampling_params": {"n": 2}})
        wait_until(lambda: {"hang-grp-0", "hang-grp-1"} <= server.in_flight())
        status, _, raw = post(server, {"rid": "hang-grp"}, "/abort_request")
        assert status == 200 and sorted(json.loads(raw)["aborted"]) == ["hang-grp-0", "hang-grp-1"]
        status, _, raw = fut.result(timeout=10)
    assert status == 200
    assert [o["meta_info"]["finish_reason"]["type"] for o in json.loads(raw)] == ["abort", "abort"]


def test_abort_all(server: Server) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(post, server, {"text": "hi", "stream": True, "rid": f"hang-all-{k}"})
                for k in range(2)]
        wait_until(lambda: {"hang-all-0", "hang-all-1"} <= server.in_flight())
        status, _, raw = post(server, {"abort_all": True}, "/abort_request")
        assert status == 200 and {"hang-all-0", "hang-all-1"} <= set(json.loads(raw)["aborted"])
        for f in futs:
            status, _, body = f.result(timeout=10)
            assert sse_events(body)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: not server.in_flight())


def test_abort_unknown_rid_is_fine(server: Server) -> None:
    status, _, raw = post(server, {"rid": "nobody"}, "/abort_request")
    assert status == 200 and json.loads(raw) == {"aborted": []}


def test_abort_request_bad_body(server: Server) -> None:
    for body in ({}, {"rid": 5}, {"abort_all": "yes"}, {"rid": ""}):
        status, _, raw = post(server, body, "/abort_request")
        assert status == 400 and json.loads(raw)["error"]["type"] == "BadRequestError"


def test_unknown_route_has_the_error_shape(server: Server) -> None:
    status, _, raw = get(server, "/nope")
    assert status == 404 and json.loads(raw)["error"]["code"] == 404
    status, _, raw = get(server, "/generate")
    assert status == 405 and json.loads(raw)["error"]["code"] == 405


# ---- an engine that stops answering (issue 29 item 6) ------------------------------------


@pytest.fixture
def strict_server(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Short bounds: /health 503 after 1 s of silence, the watchdog after 3 s."""
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"), health_generate_timeout=0.5,
                 health_check_timeout=1.0, watchdog_timeout=3.0)
    yield srv
    srv.stop()


def timed_post(server: Server, body: dict) -> tuple[float, int, bytes]:
    t0 = time.monotonic()
    status, _, raw = post(server, body)
    return time.monotonic() - t0, status, raw


def test_health_is_503_while_the_scheduler_is_silent_and_200_once_it_answers(strict_server: Server) -> None:
    srv = strict_server
    assert get(srv, "/health")[0] == 200
    srv.fake.silent = True  # no heartbeat, no answer
    t0 = time.monotonic()
    wait_until(lambda: get(srv, "/health")[0] == 503, timeout=5)
    assert 1.0 <= time.monotonic() - t0 < 3.0  # the bound is 1 s; heartbeats come every 0.5 s
    err = json.loads(get(srv, "/health")[2])["error"]
    assert err["code"] == 503 and "the scheduler has not answered" in err["message"]
    srv.fake.silent = False
    wait_until(lambda: get(srv, "/health")[0] == 200, timeout=3)
    assert srv.app[MANAGER].hung() is None  # silent with nothing in flight: not hung


def test_health_is_503_while_the_model_does_not_answer_the_scheduler(strict_server: Server) -> None:
    """The scheduler is alive (its heartbeats come, here from the test) but
    says the model has owed a step for 2 s: 503 naming the model."""
    srv = strict_server
    srv.fake.silent = True  # the test sends the heartbeats
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(srv.ipc.tokenizer_input)

    def health_after(beat: SchedulerHeartbeat) -> tuple[int, str]:
        push.send(msgspec.msgpack.encode(beat))
        time.sleep(0.05)
        status, _, raw = get(srv, "/health")
        return status, raw.decode()

    try:
        for _ in range(30):  # 1.5 s of heartbeats: the scheduler itself is never silent
            assert health_after(SchedulerHeartbeat(model_silent_s=0.5))[0] == 200
        status, text = health_after(SchedulerHeartbeat(model_silent_s=2.0))
        assert status == 503 and "the model process has not answered a step for 2.0 s" in text
        assert health_after(SchedulerHeartbeat(model_silent_s=0.0))[0] == 200
    finally:
        push.close(linger=0)
        ctx.term()
        srv.fake.silent = False


def test_deadlines_are_kept_by_the_front_end_when_the_scheduler_is_silent(strict_server: Server) -> None:
    """A stopped scheduler enforces no deadline: the front end answers each
    request at its own (plus 0.1 s: the engine is silent), asks the scheduler to abort it, and
    keeps its rid until the scheduler's final row; and, with requests in
    flight and no word from the scheduler for --watchdog-timeout, says the
    server is hung."""
    srv = strict_server
    srv.fake.silent = True
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(timed_post, srv, {"text": "hi", "rid": "dl-plain", "timeout": 1.5})
        stream = pool.submit(timed_post, srv, {"text": "hi", "rid": "dl-stream", "stream": True, "timeout": 2.0})
        took, status, raw = plain.result(timeout=10)
        assert status == 200 and 1.5 <= took < 2.5, (took, status)
        assert json.loads(raw)["meta_info"]["finish_reason"] == {"type": "abort", "message": "deadline exceeded"}
        took, status, raw = stream.result(timeout=10)
        assert status == 200 and 2.0 <= took < 3.0, (took, status)
        assert sse_events(raw)[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "deadline exceeded"}
    wait_until(lambda: {"dl-plain", "dl-stream"} <= set(srv.fake.aborts()))
    assert {"dl-plain", "dl-stream"} <= srv.in_flight()  # the scheduler still holds them
    manager = srv.app[MANAGER]
    wait_until(lambda: manager.hung() is not None, timeout=5)
    assert "watchdog: the scheduler has not answered" in manager.hung()


def test_an_answering_scheduler_gets_a_bounded_grace_to_end_a_request_itself(server: Server) -> None:
    """The scheduler normally ends a request at its deadline (with its text
    so far); while it answers, the front end waits for that, but not more
    than 2 s: this fake answers but never ends the request."""
    took, status, raw = timed_post(server, {"text": "hi", "rid": "hang-deadline", "timeout": 0.5})
    assert status == 200 and 2.5 <= took < 3.5, (took, status)
    answer = json.loads(raw)
    assert answer["meta_info"]["finish_reason"] == {"type": "abort", "message": "deadline exceeded"}
    assert answer["meta_info"]["completion_tokens"] == 3  # the tokens it had
    wait_until(lambda: "hang-deadline" in server.fake.aborts())
    wait_until(lambda: "hang-deadline" not in server.in_flight())  # freed by the scheduler's final row
