"""OpenAI's Responses API, driven by the `openai` client's
`client.responses.create`, fake scheduler behind the app."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, post
from tokenizer_proc.response_store import ResponseStore, StoredResponse
from tokenizer_proc.tokenizer import load_tokenizer

STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder))
    srv = Server(tok, tmp_path_factory.mktemp("ipc"))
    srv.fake.script = tok.encode(TEXT)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def prompt_of_last_request(server: Server) -> str:
    return server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)


def test_a_string_input_gets_a_completed_response(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(model="test", input="hi", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "test"
    assert r.output_text == TEXT
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == len(server.fake.requests()[-1].input_ids)
    assert r.usage.output_tokens == len(server.fake.script) + 1
    assert prompt_of_last_request(server) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi"
                                              "<|im_end|>\n<|im_start|>assistant\n")


def test_message_items_and_sampling_fields_reach_the_request(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(model="test", max_output_tokens=4, temperature=0.5, top_p=0.9, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "again"}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4
    sp = server.fake.requests()[-1].sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.top_p) == (4, 0.5, pytest.approx(0.9))
    assert prompt_of_last_request(server).endswith("<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n"
                                                   "again<|im_end|>\n<|im_start|>assistant\n")


def test_a_stream_sends_the_named_events_in_order_and_adds_up(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="test", input="hi", stream=True))
    names = [e.type for e in events]
    assert [n for k, n in enumerate(names) if k == 0 or n != names[k - 1]] == STREAM_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert events[-1].response.output_text == TEXT and events[-1].response.status == "completed"
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == TEXT


def test_previous_response_id_continues_a_stored_conversation(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model="test", input="hi", store=True, max_output_tokens=3)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.create(model="test", input="and then?", previous_response_id=first.id)
    assert prompt_of_last_request(server) == (
        f"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{first.output_text}<|im_end|>\n"
        "<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n")


def test_a_response_is_stateless_by_default(client: openai.OpenAI) -> None:
    r = client.responses.create(model="test", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="test", input="more", previous_response_id=r.id)
    assert "not found" in str(e.value)


@pytest.mark.parametrize("body,message", [
    ({}, "input is required"),
    ({"input": ""}, "input must not be empty"),
    ({"input": []}, "non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only input_text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "call_id 'c' matches no function_call before it"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "not supported"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be >= 1"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools are supported"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice names the function 'g', which is not among the tools (f)"),
    ({"input": "hi", "tool_choice": {"type": "mcp"}}, "tool_choice must be"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "not found"),
])
def test_bad_requests_are_a_400_naming_the_field(server: Server, body: dict, message: str) -> None:
    status, _, raw = post(server, {"model": "test", **body}, "/v1/responses")
    assert status == 400 and message in json.loads(raw)["error"]["message"]


def test_the_store_keeps_the_most_recent_responses_within_its_bounds() -> None:
    store = ResponseStore(max_responses=2, max_chars=10)
    item = StoredResponse({}, [{"role": "user", "content": "abcd"}])
    for rid in ("a", "b", "c"):
        store.put(rid, item)
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    store.put("d", StoredResponse({}, [{"role": "user", "content": "x" * 8}]))  # 8 + 4 > 10 chars
    assert len(store) == 1 and store.get("d") is not None
    store.put("huge", StoredResponse({}, [{"role": "user", "content": "x" * 11}]))
    assert store.get("huge") is None


# ---- function tools ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
CALLED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_EVENTS = ["response.created", "response.in_progress",
               "response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done",
               "response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def tool_server(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder))
    # the tiny vocabulary spells the tools long
    srv = Server(tok, tmp_path_factory.mktemp("ipc"), context_len=4096)
    srv.fake.script = tok.encode(CALLED)  # the "model" says a word, then calls
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def test_a_call_is_a_function_call_item_after_the_text(tool_server: Server, tool_client: openai.OpenAI) -> None:
    r = tool_client.responses.create(model="test", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=300)
    assert r.status == "completed" and [item.type for item in r.output] == ["message", "function_call"]
    assert r.output_text == "Let me check."
    call = r.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto" and r.parallel_tool_calls
    assert "<tools>" in prompt_of_last_request(tool_server)  # the template showed the tools
    sp = tool_server.fake.requests()[-1].sampling_params
    assert sp.grammar is not None  # the calls are constrained


def test_a_streamed_call_has_openais_events_and_adds_up(tool_client: openai.OpenAI) -> None:
    events = list(tool_client.responses.create(model="test", input="Weather in Paris?", tools=[WEATHER],
                                               tool_choice="auto", stream=True, max_output_tokens=300))
    names = [e.type for e in events]
    assert [n for k, n in enumerate(names) if k == 0 or n != names[k - 1]] == TOOL_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"][1]
    assert added.type == "function_call" and added.arguments == "" and added.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args) == {"city": "Paris"} and done.item_id == added.id
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == args and final.output[1].call_id == added.call_id
    assert final.output_text == "Let me check."


def test_a_named_tool_choice_and_the_round_trip(tool_server: Server, tool_client: openai.OpenAI) -> None:
    first = tool_client.responses.create(model="test", input="Weather in Paris?", tools=[WEATHER], store=True,
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         parallel_tool_calls=False, max_output_tokens=300)
    call = next(item for item in first.output if item.type == "function_call")
    assert first.tool_choice.name == "get_weather" and first.parallel_tool_calls is False
    expect = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response>'
              '<|im_end|>\n<|im_start|>assistant\n')
    # the history sent back as items (OpenAI's stateless way)...
    tool_client.responses.create(model="test", tools=[WEATHER], max_output_tokens=300, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert prompt_of_last_request(tool_server).endswith(expect)
    # ...or by previous_response_id: the stored answer holds the call
    tool_client.responses.create(model="test", tools=[WEATHER], max_output_tokens=300, previous_response_id=first.id,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": '{"sky": "sunny"}'}])
    assert prompt_of_last_request(tool_server).endswith(expect.replace("assistant\n<tool_call>",
                                                                         "assistant\nLet me check.\n<tool_call>"))


def test_a_call_cut_by_max_output_tokens_is_incomplete_and_not_stored_as_a_call(
        tool_server: Server, tool_client: openai.OpenAI) -> None:
    cut_at = len(tool_server.tokenizer.encode(CALLED[:CALLED.index("Paris")]))
    r = tool_client.responses.create(model="test", input="Weather in Paris?", tools=[WEATHER], store=True,
                                     max_output_tokens=cut_at)
    assert r.status == "incomplete" and [item.type for item in r.output] == ["message", "function_call"]
    assert r.output[1].status == "incomplete"
    events = list(tool_client.responses.create(model="test", input="Weather in Paris?", tools=[WEATHER],
                                               stream=True, max_output_tokens=cut_at))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output[1].status == "incomplete"
    assert not any(e.type == "response.function_call_arguments.done" for e in events)
    with pytest.raises(openai.BadRequestError, match="matches no function_call"):
        tool_client.responses.create(model="test", tools=[WEATHER], previous_response_id=r.id, input=[
            {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "1"}])
