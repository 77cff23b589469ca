"""Operations routes: /health_generate, model and server info, /abort_request."""

from __future__ import annotations

import concurrent.futures
import json
import time

from tests.tokenizer_proc.server_harness import Server, get, open_raw, post, read_until, sse_events, wait_until


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
