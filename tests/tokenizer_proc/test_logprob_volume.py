"""Logprob volume is bounded per request (issue 29 item 4): one 54 KB request
asking for top-100 prompt logprobs of a long prompt, n times, once became a
100 MB answer. Past --max-logprob-entries it is a 400 naming the bound, before
it runs; a large answer within the bound is built and encoded on a worker
thread, a chunk at a time."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.tokenizer_proc.server_harness import Server, post, sse_events
from tokenizer_proc import logprobs, native_api, openai_api
from tokenizer_proc.logprobs import ENCODE_CHUNK, encoded_list
from tokenizer_proc.tokenizer import load_tokenizer

BOUND = 100_000
PROMPT = 200  # tokens: the harness's context is 256


@pytest.fixture(scope="module")
def bounded(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"), max_logprob_entries=BOUND)
    yield srv
    srv.stop()


def prompt_ids(server: Server) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, server.tokenizer.vocab_size) for _ in range(PROMPT)]


def generate(server: Server, n: int, top: int, start: int = 0, max_new: int = 4, **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt_ids(server), "return_logprob": True, "top_logprobs_num": top,
            "logprob_start_len": start, "return_text_in_logprobs": True,
            "sampling_params": {"n": n, "max_new_tokens": max_new, "ignore_eos": True}, **extra}


def refusal(status: int, raw: bytes) -> str:
    assert status == 400, (status, raw[:300])
    return json.loads(raw)["error"]["message"]


def test_the_issue_s_request_shape_is_refused_naming_the_bound(bounded: Server) -> None:
    # (200 prompt positions + 4 new tokens) x (1 + 100) x 8 samples = 164,832 entries
    message = refusal(*post(bounded, generate(bounded, n=8, top=100))[::2])
    assert "--max-logprob-entries" in message and str(BOUND) in message and "164832" in message, message
    assert not any(r.input_ids == prompt_ids(bounded) for r in bounded.fake.requests())  # never sent


def test_output_logprobs_count_too(bounded: Server) -> None:
    # no prompt logprobs: 40 new tokens x 101 x 32 samples = 129,280
    body = generate(bounded, n=32, top=100, start=-1, max_new=40)
    body.pop("logprob_start_len")
    assert "--max-logprob-entries" in refusal(*post(bounded, body)[::2])


def test_openai_routes_are_bounded_too(bounded: Server) -> None:
    # (200 + 4) x (1 + 20) x 32 = 137,088
    body = {"prompt": prompt_ids(bounded), "max_tokens": 4, "echo": True, "logprobs": 20, "n": 32}
    assert "--max-logprob-entries" in refusal(*post(bounded, body, "/v1/completions")[::2])
    # 50 x (1 + 20) x 128 = 134,400
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "logprobs": True,
            "top_logprobs": 20, "n": 128}
    assert "--max-logprob-entries" in refusal(*post(bounded, chat, "/v1/chat/completions")[::2])


def test_within_the_bound_is_answered_in_full(bounded: Server) -> None:
    status, _, raw = post(bounded, generate(bounded, n=2, top=20))  # 204 x 21 x 2 = 8,568
    assert status == 200, raw[:300]
    for out in json.loads(raw):
        meta = out["meta_info"]
        assert len(meta["input_top_logprobs"]) == PROMPT and len(meta["input_top_logprobs"][1]) == 20


def test_a_large_answer_is_built_on_a_worker_thread_and_is_the_same(
        bounded: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    build = native_api.output_json

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return build(*args, **kwargs)

    monkeypatch.setattr(native_api, "output_json", recording)
    body = generate(bounded, n=4, top=100)  # 204 x 101 x 4 = 82,416 entries: past LARGE_ANSWER_ENTRIES
    status, _, raw = post(bounded, body)
    assert status == 200, raw[:300]
    assert threads and all(t.startswith("front-worker") for t in threads), threads
    large = json.loads(raw)
    # the same answer as the loop builds for a small one: compare with a 2-sample run's first outputs
    threads.clear()
    monkeypatch.setattr(logprobs, "LARGE_ANSWER_ENTRIES", 10**9)
    status, _, raw = post(bounded, body)
    assert status == 200 and threads and not any(t.startswith("front-worker") for t in threads)
    small = json.loads(raw)
    for a, b in zip(large, small):
        a["meta_info"].pop("id"), b["meta_info"].pop("id")
        a["meta_info"].pop("e2e_latency"), b["meta_info"].pop("e2e_latency")
        assert a == b


def test_a_large_streamed_answer_is_built_on_a_worker_thread(bounded: Server,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    build = native_api.output_json

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return build(*args, **kwargs)

    builds = []
    input_logprobs = native_api._input_logprobs

    def counting(*args: Any) -> dict[str, Any]:
        builds.append(1)
        return input_logprobs(*args)

    monkeypatch.setattr(native_api, "output_json", recording)
    monkeypatch.setattr(native_api, "_input_logprobs", counting)
    status, _, raw = post(bounded, generate(bounded, n=1, top=100, max_new=12, stream=True))  # 212 x 101
    assert status == 200
    assert threads and all(t.startswith("front-worker") for t in threads), threads
    events = sse_events(raw)
    assert len(events) >= 2
    assert all(e["meta_info"]["input_top_logprobs"] == events[-1]["meta_info"]["input_top_logprobs"]
               for e in events)  # every event repeats them (SGLang's), built once
    assert len(builds) == 1, len(builds)


def _recording_threads(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    """Records the thread each call of module.name runs on."""
    threads: list[str] = []
    fn = getattr(module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return threads


def _without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


@pytest.mark.parametrize("route, body, layout", [
    # (200 + 4) x (1 + 20) x 4 = 17,136 entries: past LARGE_ANSWER_ENTRIES
    ("/v1/completions", {"max_tokens": 4, "echo": True, "logprobs": 20, "n": 4}, "completion_logprobs"),
    # 50 x (1 + 20) x 16 = 16,800
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
                              "logprobs": True, "top_logprobs": 20, "n": 16}, "chat_logprobs"),
])
def test_a_large_openai_answer_is_built_on_a_worker_thread_and_is_the_same(
        bounded: Server, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any], layout: str) -> None:
    threads = _recording_threads(monkeypatch, openai_api, layout)
    if "messages" not in body:
        body = {"prompt": prompt_ids(bounded), **body}
    status, _, raw = post(bounded, body, route)
    assert status == 200, raw[:300]
    assert threads and all(t.startswith("front-worker") for t in threads), threads
    large = json.loads(raw)
    threads.clear()
    monkeypatch.setattr(logprobs, "LARGE_ANSWER_ENTRIES", 10**9)
    status, _, raw = post(bounded, body, route)
    assert status == 200 and threads and not any(t.startswith("front-worker") for t in threads)
    assert _without_ids(large) == _without_ids(json.loads(raw))


def test_a_large_openai_stream_chunk_is_built_on_a_worker_thread_and_is_the_same(
        bounded: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # an echoed prompt's logprobs come in the choice's first chunk: 200 x 21 = 4,200 entries
    body = {"prompt": prompt_ids(bounded), "max_tokens": 6, "echo": True, "logprobs": 20, "n": 2, "stream": True}
    threads = _recording_threads(monkeypatch, openai_api, "completion_logprobs")
    monkeypatch.setattr(logprobs, "LARGE_ANSWER_ENTRIES", 4_000)  # the echo chunks only
    status, _, raw = post(bounded, body, "/v1/completions")
    assert status == 200, raw[:300]
    assert any(t.startswith("front-worker") for t in threads), threads
    assert not all(t.startswith("front-worker") for t in threads), threads  # later chunks: on the loop
    off_loop = _per_choice(sse_events(raw))
    threads.clear()
    monkeypatch.setattr(logprobs, "LARGE_ANSWER_ENTRIES", 10**9)
    status, _, raw = post(bounded, body, "/v1/completions")
    assert status == 200 and threads and not any(t.startswith("front-worker") for t in threads)
    assert off_loop == _per_choice(sse_events(raw))


def _per_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's chunks in their order. How the n choices' chunks interleave
    is not the same from run to run: while one choice's large chunk is built on a
    worker thread, the other's may go first."""
    out: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out.setdefault(choice["index"], []).append({**_without_ids(chunk), "choices": [choice]})
    return out


@pytest.mark.parametrize("size", [0, 1, ENCODE_CHUNK - 1, ENCODE_CHUNK, ENCODE_CHUNK + 1, 3 * ENCODE_CHUNK + 7])
def test_chunked_encoding_is_the_plain_encoding(size: int) -> None:
    rng = random.Random(size)
    items = [None if rng.random() < 0.1 else [[-rng.random(), rng.randrange(9), "t\u00e9\"x"]] for _ in range(size)]
    assert msgspec.json.encode({"a": encoded_list(iter(items))}) == msgspec.json.encode({"a": items})
