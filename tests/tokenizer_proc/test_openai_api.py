"""OpenAI-compatible routes, driven by the `openai` client itself (and raw
HTTP where the client hides the wire format), fake scheduler behind the app."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import openai
import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, open_raw, post, read_until, sse_events, wait_until

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


@pytest.fixture
def hold(server: Server) -> Iterator[None]:
    """Every new request hangs after its first chunk until aborted."""
    server.fake.hold = True
    yield
    server.fake.hold = False


def last_request(server: Server):  # -> TokenizedGenerateReq
    return server.fake.requests()[-1]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["test"]
    assert client.models.retrieve("test").id == "test"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion(server: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(model="test", prompt="hello", max_tokens=100, temperature=0, seed=3)
    assert r.object == "text_completion" and r.model == "test" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    assert r.choices[0].text == TEXT and r.choices[0].finish_reason == "stop"
    n_prompt = len(server.tokenizer.encode("hello"))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(server.script) + 1  # EOS counted
    assert r.usage.total_tokens == n_prompt + len(server.script) + 1
    req = last_request(server)
    assert req.input_ids == server.tokenizer.encode("hello")
    assert req.sampling_params.max_new_tokens == 100 and req.sampling_params.temperature == 0
    assert req.sampling_params.seed == 3


def test_completion_default_max_tokens_and_length(server: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(model="test", prompt="hello")
    assert r.choices[0].finish_reason == "length"
    assert last_request(server).sampling_params.max_new_tokens == 16  # OpenAI's default
    assert r.usage.completion_tokens == 16


def test_completion_prompt_list_and_n(server: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(model="test", prompt=["hello", [5, 6, 7]], n=2, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == server.tokenizer.decode(server.script[:3]) for c in r.choices)
    assert r.usage.prompt_tokens == len(server.tokenizer.encode("hello")) + 3
    assert r.usage.completion_tokens == 12
    reqs = server.fake.requests()[-4:]
    assert sorted(len(q.input_ids) for q in reqs) == sorted([len(server.tokenizer.encode("hello"))] * 2 + [3, 3])


def test_chat(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="whatever", messages=MESSAGES)
    assert r.object == "chat.completion" and r.model == "test" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == TEXT
    assert r.choices[0].finish_reason == "stop"
    prompt = server.tokenizer.apply_chat_template(MESSAGES)
    assert last_request(server).input_ids == prompt
    assert r.usage.prompt_tokens == len(prompt)
    # No max_tokens: the room the context leaves.
    assert last_request(server).sampling_params.max_new_tokens == server.info.context_len - len(prompt)


def test_chat_text_parts_and_max_completion_tokens(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="test", max_completion_tokens=4,
        messages=[{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert last_request(server).input_ids == server.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_chat_n(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="test", messages=MESSAGES, n=2, max_tokens=5, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(server.tokenizer.apply_chat_template(MESSAGES))  # counted once
    assert sorted(q.sampling_params.seed for q in server.fake.requests()[-2:]) == [11, 12]


def test_chat_stream_with_usage(server: Server, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="test", messages=MESSAGES, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
    assert len(chunks) > 4  # it did stream
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(server.script) + 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stream(server: Server, client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="test", prompt="hello", max_tokens=100, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)  # not asked for


def test_stream_n_choices(server: Server, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="test", messages=MESSAGES, n=2, stream=True,
                                                 max_tokens=7))
    for k in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert "".join(c.delta.content or "" for c in mine) == server.tokenizer.decode(server.script[:7])
        assert mine[-1].finish_reason == "length"


def test_stop_strings_streamed(server: Server, client: openai.OpenAI) -> None:
    stop = "wör"
    expect = TEXT[:TEXT.index(stop)]
    chunks = list(client.chat.completions.create(model="test", messages=MESSAGES, stop=[stop, "zzz"],
                                                 stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model="test", prompt="x", stop=stop, max_tokens=100)
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop


def test_chat_logprobs(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="test", messages=MESSAGES, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    text = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    assert len(content) == len(server.script)  # the EOS that ended it is not a content token
    for entry, t in zip(content, server.script):
        assert entry.token == text(t) and entry.logprob == -t / 1000
        assert entry.bytes == list(text(t).encode())
        assert [(x.token, x.logprob) for x in entry.top_logprobs] == [
            (text(t), -t / 1000), (text(t + 1), -(t + 1) / 1000)]
    req = last_request(server)
    assert req.return_logprob and req.top_logprobs_num == 2


def test_chat_logprobs_streamed(server: Server, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="test", messages=MESSAGES, logprobs=True,
                                                 stream=True, max_tokens=8))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [-t / 1000 for t in server.script[:8]]


def test_completion_logprobs(server: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(model="test", prompt="hello", max_tokens=5, logprobs=1)
    lp = r.choices[0].logprobs
    text = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    ids = server.script[:5]
    assert lp.tokens == [text(t) for t in ids]
    assert lp.token_logprobs == [-t / 1000 for t in ids]
    assert lp.top_logprobs == [{text(t): -t / 1000} for t in ids]
    offsets = [sum(len(text(t)) for t in ids[:k]) for k in range(5)]
    assert lp.text_offset == offsets
    assert client.completions.create(model="test", prompt="hello", max_tokens=2).choices[0].logprobs is None


def test_completion_echo_with_logprobs(server: Server, client: openai.OpenAI) -> None:
    """The prompt's tokens and logprobs, then the completion's, as lm-eval's
    local-completions reads them (logprobs.token_logprobs[ctxlen:-1])."""
    prompt = [21, 22, 23, 24]
    r = client.completions.create(model="test", prompt=prompt, max_tokens=3, logprobs=1, echo=True)
    text = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    ids = prompt + server.script[:3]
    choice, lp = r.choices[0], r.choices[0].logprobs
    prompt_text = server.tokenizer.decode(prompt, skip_special_tokens=False)
    assert choice.text == prompt_text + server.tokenizer.decode(server.script[:3])
    assert lp.tokens == [text(t) for t in ids]
    assert lp.token_logprobs == [None] + [-t / 1000 for t in ids[1:]]
    assert lp.top_logprobs == [None] + [{text(t): -t / 1000} for t in ids[1:]]
    prompt_offsets = [sum(len(text(t)) for t in prompt[:k]) for k in range(4)]
    out_offsets = [len(prompt_text) + sum(len(text(t)) for t in server.script[:k]) for k in range(3)]
    assert lp.text_offset == prompt_offsets + out_offsets
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3
    assert last_request(server).logprob_start_len == 0


def test_completion_echo_with_max_tokens_0_returns_the_prompt_alone(server: Server, client: openai.OpenAI) -> None:
    r = client.completions.create(model="test", prompt=["hello", "hi"], max_tokens=0, logprobs=0, echo=True)
    assert [c.text for c in r.choices] == ["hello", "hi"]
    for c, p in zip(r.choices, ["hello", "hi"]):
        ids = server.tokenizer.encode(p)
        assert c.finish_reason == "length"
        assert c.logprobs.token_logprobs == [None] + [-t / 1000 for t in ids[1:]]
        assert len(c.logprobs.tokens) == len(ids)
    assert r.usage.completion_tokens == 0
    # served by generating one token (the server's minimum), none of it shown
    assert last_request(server).sampling_params.max_new_tokens == 1
    # echo without logprobs: the text only, no prompt logprobs asked for
    r = client.completions.create(model="test", prompt="hello", max_tokens=2, echo=True)
    assert r.choices[0].text == "hello" + server.tokenizer.decode(server.script[:2])
    assert r.choices[0].logprobs is None and last_request(server).logprob_start_len == -1


@pytest.mark.parametrize("max_tokens, logprobs", [(3, 1), (3, None), (0, 0)])
def test_streamed_echo_adds_up_to_the_unstreamed_answer(server: Server, client: openai.OpenAI, max_tokens: int,
                                                        logprobs: int | None) -> None:
    """The prompt (and its logprobs) come in each choice's first chunk, as in vLLM."""
    args = dict(model="test", prompt=[[21, 22, 23, 24], "hello"], max_tokens=max_tokens, logprobs=logprobs, echo=True)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    for c in whole.choices:
        parts = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(p.text for p in parts) == c.text
        assert parts[-1].finish_reason == c.finish_reason
        if logprobs is None:
            assert all(p.logprobs is None for p in parts)
            continue
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((getattr(p.logprobs, key) for p in parts if p.logprobs), []) == getattr(c.logprobs, key)


BAD = [
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, "chat template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10_000}, "context length"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n must"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "structural_tag"}},
     "structural_tag is not supported"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}, "regex": "a+"},
     "mutually exclusive"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "invalid json_schema"),
    ("/v1/completions", {"prompt": "x", "regex": "(unclosed"}, "invalid regex"),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= undefined_rule"}, "invalid ebnf"),
    ("/v1/completions", {"prompt": "x", "json_schema": "{not json"}, "invalid json_schema"),
    ("/v1/completions", {"prompt": "x", "regex": "a+", "min_tokens": 2}, "cannot be combined with a grammar"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, "out of range"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo is not supported on chat"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", b"{bad json", "malformed"),
]


@pytest.mark.parametrize("path,body,expect", BAD, ids=[f"{p}:{e}" for p, _, e in BAD])
def test_bad_requests(server: Server, path: str, body: object, expect: str) -> None:
    before = len(server.fake.requests())
    status, ctype, raw = post(server, body, path)
    assert status == 400 and ctype == "application/json"
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == 400
    assert expect in err["message"], err["message"]
    assert len(server.fake.requests()) == before


def test_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test", messages=MESSAGES, temperature=5)
    assert "temperature" in str(e.value)


def test_unknown_fields_are_ignored(server: Server) -> None:
    status, _, raw = post(server, {"prompt": "x", "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
                                   "frequency_penalty": 0}, "/v1/completions")
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"


def test_raw_stream_wire_format(server: Server) -> None:
    status, ctype, raw = post(server, {"messages": MESSAGES, "stream": True, "max_tokens": 4,
                                       "stream_options": {"include_usage": True}}, "/v1/chat/completions")
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)  # ends with data: [DONE]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_abort_is_an_error(server: Server, client: openai.OpenAI, hold: None) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(client.chat.completions.create, model="test", messages=MESSAGES)

        def streamed() -> list:
            return list(client.completions.create(model="test", prompt="x", stream=True))
        stream = pool.submit(streamed)
        wait_until(lambda: len(server.in_flight()) == 2)
        status, _, raw = post(server, {"abort_all": True}, "/abort_request")
        assert status == 200 and len(json.loads(raw)["aborted"]) == 2
        with pytest.raises(openai.BadRequestError, match="aborted"):
            plain.result(timeout=10)
        with pytest.raises(openai.APIError, match="aborted"):
            stream.result(timeout=10)
    wait_until(lambda: not server.in_flight())


def test_disconnect_mid_stream_aborts(server: Server, hold: None) -> None:
    sock = open_raw(server, {"messages": MESSAGES, "stream": True, "n": 2}, "/v1/chat/completions")
    read_until(sock, b"data: ")
    wait_until(lambda: len(server.in_flight()) == 2)
    rids = server.in_flight()
    sock.close()
    wait_until(lambda: rids <= set(server.fake.aborts()))
    wait_until(lambda: not server.in_flight())


def test_disconnect_while_waiting_aborts(server: Server, hold: None) -> None:
    sock = open_raw(server, {"prompt": ["a", "b"], "max_tokens": 50}, "/v1/completions")
    wait_until(lambda: len(server.in_flight()) == 2)
    rids = server.in_flight()
    assert all(r.startswith("cmpl-") for r in rids)
    sock.close()
    wait_until(lambda: rids <= set(server.fake.aborts()))
    wait_until(lambda: not server.in_flight())
