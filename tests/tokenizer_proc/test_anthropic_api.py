"""Anthropic's Messages API, driven by the `anthropic` client itself (raw
HTTP where the client hides the wire format), fake scheduler behind the app."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, post
from tokenizer_proc.tokenizer import load_tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder))
    srv = Server(tok, tmp_path_factory.mktemp("ipc"))
    srv.fake.script = tok.encode(TEXT)  # (the harness drops a SentencePiece BOS; this tokenizer adds none)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def prompt_of_last_request(server: Server) -> str:
    return server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)


def test_a_message_answers_in_anthropic_shape(server: Server, client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="test", max_tokens=100, messages=HI)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "test"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == TEXT
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == len(server.fake.requests()[-1].input_ids)
    assert m.usage.output_tokens == len(server.tokenizer.encode(TEXT)) + 1  # EOS counted


def test_system_blocks_and_turns_go_through_the_chat_template(server: Server, client: anthropic.Anthropic) -> None:
    client.messages.create(model="test", max_tokens=5, system=[{"type": "text", "text": "Be "}, {"type": "text",
                                                                                                   "text": "brief."}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "user", "content": "again"}])
    assert prompt_of_last_request(server) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi"
                                              "<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
                                              "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def test_a_last_assistant_message_is_continued(server: Server, client: anthropic.Anthropic) -> None:
    client.messages.create(model="test", max_tokens=5, messages=HI + [{"role": "assistant", "content": "Sure:"}])
    assert prompt_of_last_request(server).endswith("<|im_start|>assistant\nSure:")


def test_max_tokens_and_stop_sequences_set_the_stop_reason(server: Server, client: anthropic.Anthropic) -> None:
    # (this client version no longer sends sampling fields itself)
    m = client.messages.create(model="test", max_tokens=3, messages=HI, extra_body={"temperature": 0.5, "top_k": 4})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    req = server.fake.requests()[-1]
    assert req.sampling_params.temperature == 0.5 and req.sampling_params.top_k == 4
    m = client.messages.create(model="test", max_tokens=100, messages=HI, stop_sequences=["wörld"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "wörld"
    assert m.content[0].text == TEXT[:TEXT.index("wörld")]


def test_a_stream_has_anthropic_events_and_adds_up_to_the_message(server: Server,
                                                                  client: anthropic.Anthropic) -> None:
    names = []
    with client.messages.stream(model="test", max_tokens=100, messages=HI) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == TEXT and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(server.fake.script) + 1
    raw = [n for n in names if n not in ("text",)]  # the client adds its own "text" events
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}


def test_the_raw_stream_names_each_event_and_carries_the_stop_reason(server: Server) -> None:
    status, _, body = post(server, {"model": "t", "max_tokens": 3, "messages": HI, "stream": True}, "/v1/messages")
    assert status == 200
    events = [chunk.split("\n") for chunk in body.decode().strip().split("\n\n")]
    assert all(e[0].startswith("event: ") and e[1].startswith("data: ") for e in events)
    data = [json.loads(e[1][len("data: "):]) for e in events]
    assert all(e[0] == f"event: {d['type']}" for e, d in zip(events, data))
    delta = next(d for d in data if d["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": 3}


def test_count_tokens_counts_the_templated_prompt(server: Server, client: anthropic.Anthropic) -> None:
    r = client.messages.count_tokens(model="test", system="Be brief.", messages=HI)
    ids = server.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}] + HI)
    assert r.input_tokens == len(ids)


@pytest.mark.parametrize("body,message", [
    ({"max_tokens": 5, "messages": []}, "at least one message"),
    ({"messages": HI}, "max_tokens: field required"),
    ({"max_tokens": 0, "messages": HI}, "max_tokens must be >= 1"),
    ({"max_tokens": "5", "messages": HI}, "max_tokens must be an integer"),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, "temperature must be in"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role must be"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "only text blocks"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}]},
     "tool_use_id 'toolu_9' matches no earlier tool_use block"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice names the function 'g', which is not among"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "only client tools"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "sometimes"}}, "tool_choice.type must be"),
])
def test_bad_requests_get_anthropics_error_shape(server: Server, body: dict, message: str) -> None:
    status, _, raw = post(server, {"model": "test", **body}, "/v1/messages")
    err = json.loads(raw)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert message in err["error"]["message"]


def test_the_client_raises_its_own_error_for_a_bad_request(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="test", max_tokens=5, messages=[])
    assert "at least one message" in str(e.value)


def test_thinking_is_ignored_by_a_server_without_a_reasoning_parser(server: Server,
                                                                    client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="test", max_tokens=3, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "text" and server.fake.requests()[-1].thinking_budget is None


def test_the_api_key_may_come_as_x_api_key(server: Server, tmp_path: Path) -> None:
    keyed = Server(server.tokenizer, tmp_path, api_key="sekret")
    try:
        ok = anthropic.Anthropic(base_url=keyed.url, api_key="sekret", max_retries=0, timeout=10)
        assert ok.messages.count_tokens(model="test", messages=HI).input_tokens > 0
        bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.count_tokens(model="test", messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"  # Anthropic's shape, from the gate
    finally:
        keyed.stop()


# ---- tools ------------------------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALLED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder))
    # the tiny vocabulary spells the tools long
    srv = Server(tok, tmp_path_factory.mktemp("ipc"), context_len=4096)
    srv.fake.script = tok.encode(CALLED)  # the "model" says a word, then calls
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server: Server) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def test_a_call_is_a_tool_use_block_with_its_input(tool_server: Server, tool_client: anthropic.Anthropic) -> None:
    m = tool_client.messages.create(model="test", max_tokens=300, messages=ASK, tools=[WEATHER])
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "Let me check."
    use = m.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert "<tools>" in prompt_of_last_request(tool_server)
    assert tool_server.fake.requests()[-1].sampling_params.grammar is not None  # the calls are constrained


def test_a_streamed_call_has_anthropics_events_and_adds_up(tool_server: Server,
                                                           tool_client: anthropic.Anthropic) -> None:
    with tool_client.messages.stream(model="test", max_tokens=300, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"] and starts[1].input == {}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [e.type for e in events].count("content_block_stop") == 2
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}
    assert final.content[1].id == starts[1].id and final.content[0].text == "Let me check."


def test_a_named_tool_choice_and_a_tool_result_round_trip(tool_server: Server,
                                                          tool_client: anthropic.Anthropic) -> None:
    first = tool_client.messages.create(model="test", max_tokens=300, messages=ASK, tools=[WEATHER],
                                        tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True})
    use = next(b for b in first.content if b.type == "tool_use")
    tool_client.messages.create(model="test", max_tokens=300, tools=[WEATHER], messages=ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": '{"sky": "sunny"}'}]},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert prompt_of_last_request(tool_server).endswith(
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n'
        '</tool_response><|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n')
    n = tool_client.messages.count_tokens(model="test", messages=ASK, tools=[WEATHER])
    assert n.input_tokens > tool_client.messages.count_tokens(model="test", messages=ASK).input_tokens


def test_an_error_tool_result_says_so_and_a_cut_call_is_left_out(tool_server: Server,
                                                                   tool_client: anthropic.Anthropic) -> None:
    tool_client.messages.create(model="test", max_tokens=300, tools=[WEATHER], messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no network",
                                      "is_error": True}]}])
    assert prompt_of_last_request(tool_server).endswith(
        "<tool_response>\nError: no network\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    cut_at = len(tool_server.tokenizer.encode(CALLED[:CALLED.index("Paris")]))
    m = tool_client.messages.create(model="test", max_tokens=cut_at, messages=ASK, tools=[WEATHER])
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["text"]
