"""The HTTP front end alone: the real app on a real port, a fake scheduler
behind it (both on one uvloop in a background thread), plain HTTP clients."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
from typing import Any

import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import (CONTEXT_LEN, Server, open_raw, post, read_until,
                                                 sse_events, wait_until)


META_KEYS = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "num_retractions", "queue_time",
             "finish_reason", "e2e_latency"}


def test_health(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {}
    conn.close()


def test_generate_non_stream(server: Server) -> None:
    status, ctype, body = post(server, {"text": "hello", "rid": "plain-1",
                                        "sampling_params": {"temperature": 0, "top_k": 0}})
    assert status == 200 and ctype == "application/json"
    out = json.loads(body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["text"] == TEXT
    assert out["output_ids"] == server.script + [server.eos]  # the stop token stays in the ids
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "plain-1"
    assert meta["prompt_tokens"] == len(server.tokenizer.encode("hello"))
    assert meta["completion_tokens"] == len(server.script) + 1
    assert meta["finish_reason"] == {"type": "stop", "matched": server.eos}
    assert meta["cached_tokens"] == 0 and meta["num_retractions"] == 0
    assert 0 < meta["e2e_latency"] < 10
    req = next(r for r in server.fake.requests() if r.rid == "plain-1")
    assert req.input_ids == server.tokenizer.encode("hello")
    assert req.sampling_params.temperature == 0 and req.sampling_params.top_k == -1  # 0 = off
    assert req.sampling_params.max_new_tokens == 128 and not req.stream


def test_generate_input_ids_and_length_finish(server: Server) -> None:
    status, _, body = post(server, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
    assert status == 200
    out = json.loads(body)
    assert re.fullmatch(r"[0-9a-f]{32}", out["meta_info"]["id"])  # generated uuid4 hex
    assert out["output_ids"] == server.script[:4]
    assert out["text"] == server.tokenizer.decode(server.script[:4])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert out["meta_info"]["prompt_tokens"] == 3


def test_matched_stop_token_not_in_text(server: Server) -> None:
    status, _, body = post(server, {"text": "hi", "sampling_params": {"skip_special_tokens": False}})
    assert status == 200
    assert json.loads(body)["text"] == TEXT  # no "</s>" even though specials are kept


def test_generate_stream(server: Server) -> None:
    status, ctype, body = post(server, {"text": "hello", "stream": True, "rid": "stream-1"})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(body)
    assert len(events) > 2
    for prev, cur in zip(events, events[1:]):  # cumulative: each extends the last
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    for e in events:
        assert set(e) == {"text", "output_ids", "meta_info"} and set(e["meta_info"]) == META_KEYS
        assert "\ufffd" not in e["text"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": server.eos}
    assert last["text"] == TEXT and last["output_ids"] == server.script + [server.eos]
    assert next(r for r in server.fake.requests() if r.rid == "stream-1").stream


BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("malformed json", b'{"text": "hi"', "malformed JSON"),
    ("not an object", b"[1, 2]", "JSON object"),
    ("text not str", {"text": 5}, "text must be a string"),
    ("input_ids not ints", {"input_ids": ["a"]}, "input_ids"),
    ("input_ids bools", {"input_ids": [True]}, "input_ids"),
    ("stream not bool", {"text": "hi", "stream": "yes"}, "stream"),
    ("rid not str", {"text": "hi", "rid": 5}, "rid"),
    ("sampling_params not object", {"text": "hi", "sampling_params": [1]}, "sampling_params"),
    ("temperature str", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("max_new_tokens float", {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ("max_new_tokens bool", {"text": "hi", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ("stop_token_ids str", {"text": "hi", "sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids"),
    ("ignore_eos int", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
    ("seed str", {"text": "hi", "sampling_params": {"seed": "1"}}, "seed"),
    ("both prompts", {"text": "hi", "input_ids": [5]}, "exactly one"),
    ("no prompt", {"sampling_params": {}}, "exactly one"),
    ("empty text", {"text": ""}, "empty"),
    ("empty input_ids", {"input_ids": []}, "empty"),
    ("id too large", {"input_ids": [5, 10**6]}, "out of range"),
    ("id negative", {"input_ids": [-1]}, "out of range"),
    ("prompt fills context", {"input_ids": [5] * CONTEXT_LEN}, "must be shorter than the model's context length"),
    ("prompt + max_new over context",
     {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": CONTEXT_LEN - 99}}, "context length"),
    ("max_new_tokens -1", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
    ("temperature negative", {"text": "hi", "sampling_params": {"temperature": -0.1}}, "temperature"),
    ("top_p 0", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ("top_p above 1", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("top_k -2", {"text": "hi", "sampling_params": {"top_k": -2}}, "top_k must be -1 or 0 (both: off)"),
    ("min_p above 1", {"text": "hi", "sampling_params": {"min_p": 2}}, "min_p"),
    ("unknown sampling key", {"text": "hi", "sampling_params": {"frobnicate": 1}}, "frobnicate"),
    ("unknown top-level key", {"text": "hi", "sampling_param": {}}, "sampling_param"),
    ("empty prompt list", {"text": []}, "empty"),
    ("empty text in list", {"text": ["a", ""]}, "empty"),
    ("text list of ints", {"text": ["a", 5]}, "text must be"),
    ("rid list wrong length", {"text": ["a", "b"], "rid": ["x"]}, "one per prompt"),
    ("rid list for one prompt", {"text": "a", "rid": ["x"]}, "rid"),
    ("n 0", {"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("n str", {"text": "hi", "sampling_params": {"n": "2"}}, "sampling_params.n"),
    ("stop empty", {"text": "hi", "sampling_params": {"stop": ""}}, "sampling_params.stop"),
    ("stop not str", {"text": "hi", "sampling_params": {"stop": [1]}}, "sampling_params.stop"),
    ("top_logprobs_num negative", {"text": "hi", "return_logprob": True, "top_logprobs_num": -1},
     "top_logprobs_num"),
    ("logprob_start_len at the prompt's length",
     {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len (3)"),
    ("logprob_start_len below -1", {"text": "hi", "return_logprob": True, "logprob_start_len": -2},
     "logprob_start_len"),
    ("return_logprob str", {"text": "hi", "return_logprob": "yes"}, "return_logprob"),
]


@pytest.mark.parametrize("body,expect", [(b, e) for _, b, e in BAD_REQUESTS],
                         ids=[name for name, _, _ in BAD_REQUESTS])
def test_bad_request(server: Server, body: Any, expect: str) -> None:
    n_before = len(server.fake.requests())
    status, ctype, raw = post(server, body)
    assert status == 400 and ctype == "application/json"
    out = json.loads(raw)
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "code"}
    assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert expect in out["error"]["message"]
    assert len(server.fake.requests()) == n_before  # nothing reached the scheduler


def test_limits_are_inclusive(server: Server) -> None:
    """prompt + max_new_tokens == context_len is allowed."""
    status, _, _ = post(server, {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 56}})
    assert status == 200


def test_disconnect_mid_stream_aborts(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "stream": True, "rid": "hang-stream"})
    read_until(sock, b"data: ")  # the first update arrived
    assert "hang-stream" in server.in_flight()
    sock.close()
    wait_until(lambda: "hang-stream" in server.fake.aborts())
    # The scheduler answers the abort with a final row; then the rid is free.
    wait_until(lambda: "hang-stream" not in server.in_flight())


def test_disconnect_while_waiting_aborts(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "rid": "hang-plain"})
    wait_until(lambda: any(r.rid == "hang-plain" for r in server.fake.requests()))
    sock.close()
    wait_until(lambda: "hang-plain" in server.fake.aborts())
    wait_until(lambda: "hang-plain" not in server.in_flight())


def test_duplicate_rid_rejected(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "stream": True, "rid": "hang-dup"})
    read_until(sock, b"data: ")
    status, _, raw = post(server, {"text": "hi", "rid": "hang-dup"})
    assert status == 400
    assert json.loads(raw)["error"]["type"] == "BadRequestError"
    assert "hang-dup" in json.loads(raw)["error"]["message"]
    assert [r.rid for r in server.fake.requests()].count("hang-dup") == 1
    sock.close()
    wait_until(lambda: "hang-dup" not in server.in_flight())


def test_bad_requests_do_not_disturb_one_in_flight(server: Server) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, server, {"text": "hi", "stream": True, "rid": "slow-1"})
        wait_until(lambda: "slow-1" in server.in_flight())
        for _, body, _ in BAD_REQUESTS:
            assert post(server, body)[0] == 400
        assert post(server, {"text": "x", "rid": "slow-1"})[0] == 400  # its rid is taken
        assert "slow-1" in server.in_flight()  # still running
        status, _, body = slow.result(timeout=10)
    assert status == 200
    last = sse_events(body)[-1]
    assert last["text"] == TEXT and last["meta_info"]["finish_reason"]["type"] == "stop"
    assert "slow-1" not in server.fake.aborts()


def test_concurrent_requests(server: Server) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, server, {"text": "hi", "stream": i % 2 == 0}) for i in range(8)]
        results = [f.result(timeout=10) for f in futures]
    for i, (status, _, body) in enumerate(results):
        assert status == 200
        out = sse_events(body)[-1] if i % 2 == 0 else json.loads(body)
        assert out["text"] == TEXT


def test_garbage_from_scheduler_is_survived(server: Server) -> None:
    async def send_garbage() -> None:
        await server.fake.push.send(b"\x00 not msgpack")
    server.call(send_garbage())
    status, _, body = post(server, {"text": "hi"})
    assert status == 200 and json.loads(body)["text"] == TEXT


def test_handler_error_is_a_500_for_that_request_only(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        raise RuntimeError("boom")
    monkeypatch.setattr(server.tokenizer, "decode", broken_decode)
    status, _, body = post(server, {"text": "hi"})
    assert status == 500
    assert json.loads(body)["error"]["type"] == "InternalServerError"
    status, _, body = post(server, {"text": "hi", "stream": True})
    assert status == 200 and b'"InternalServerError"' in body and body.endswith(b"data: [DONE]\n\n")
    monkeypatch.undo()
    status, _, body = post(server, {"text": "hi"})
    assert status == 200 and json.loads(body)["text"] == TEXT


def test_nothing_left_in_flight(server: Server) -> None:
    wait_until(lambda: not server.in_flight())
