"""OpenAI-shaped clients read our streams as they read OpenAI's and vLLM's:
model ids with a slash resolve, and streamed chunks of a request that fans
out (n > 1, a list of prompts) carry one choice each, with its own `index`
(prompt-major: prompt i's sample j is i * n + j), its own logprobs, `usage`
null until one last chunk with no choices and the usage of the whole request.
Fake scheduler behind the app; tests/e2e/test_openai_streaming_server.py
checks the texts against a real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.tokenizer_proc.server_harness import Server, get, post, sse_events
from tokenizer_proc.tokenizer import load_tokenizer

HF_ID = "org/model"


@pytest.fixture(scope="module")
def hf_named(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"), served_model_name=HF_ID)
    yield srv
    srv.stop()


def test_model_id_with_a_slash_is_found(hf_named: Server) -> None:
    status, _, raw = get(hf_named, f"/v1/models/{HF_ID}")
    assert status == 200 and json.loads(raw)["id"] == HF_ID
    assert get(hf_named, "/v1/models/org/other")[0] == 404
    assert get(hf_named, "/v1/models/org")[0] == 404
    client = openai.OpenAI(base_url=hf_named.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    assert client.models.retrieve(HF_ID).id == HF_ID
    assert [m.id for m in client.models.list().data] == [HF_ID]
    client.close()


def check_stream_shape(events: list[dict[str, Any]], choices: int, chat: bool, logprobs: bool) -> None:
    """Every chunk: one choice (its index in range) and usage null; then one
    chunk with no choices and the usage. Per index: (chat) a role chunk
    first, then content deltas; exactly one finish_reason, on its last chunk;
    logprobs on every content chunk when asked for."""
    *body, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    seen: dict[int, list[dict[str, Any]]] = {}
    for e in body:
        assert e["usage"] is None and len(e["choices"]) == 1, e
        c = e["choices"][0]
        assert 0 <= c["index"] < choices
        seen.setdefault(c["index"], []).append(c)
    assert sorted(seen) == list(range(choices))
    for per_index in seen.values():
        reasons = [c["finish_reason"] for c in per_index]
        assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
        rest = per_index
        if chat:
            assert per_index[0]["delta"] == {"role": "assistant", "content": ""}
            assert per_index[0]["logprobs"] is None
            rest = per_index[1:]
            assert all("role" not in c["delta"] for c in rest)
        for c in rest:
            has_text = bool(c["delta"].get("content") if chat else c["text"])
            if logprobs and has_text:
                lp = c["logprobs"]
                assert lp is not None and (lp["content"] if chat else lp["tokens"]), c
            if not logprobs:
                assert c["logprobs"] is None


@pytest.mark.parametrize("prompts,n", [(["a", "b", "c"], 1), ("a", 2), (["a", "b"], 2)])
def test_streamed_completion_chunks_have_openai_shape(server: Server, prompts: Any, n: int) -> None:
    count = (len(prompts) if isinstance(prompts, list) else 1) * n
    status, _, raw = post(server, {"prompt": prompts, "n": n, "max_tokens": 7, "stream": True, "logprobs": 2,
                                   "stream_options": {"include_usage": True}}, "/v1/completions")
    assert status == 200
    check_stream_shape(sse_events(raw), count, chat=False, logprobs=True)


@pytest.mark.parametrize("logprobs", [False, True])
def test_streamed_chat_chunks_have_openai_shape(server: Server, logprobs: bool) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 2}
    status, _, raw = post(server, body, "/v1/chat/completions")
    assert status == 200
    check_stream_shape(sse_events(raw), 3, chat=True, logprobs=logprobs)
