"""A chat request's tools, before and after the model: tool_choice in each
mode and the grammar it gives, the 400s (a bad parameters schema naming the
tool, an unknown named function, tools beside another grammar, a tool
result answering no call), the chat template that renders tools (the shipped
ChatML one for a ChatML model whose template has none, the model's own when
it handles tools), and the answer's shape through the real HTTP app with a
fake scheduler that plays back a recorded output: the `openai` client's
accumulated stream equals the whole answer, a call cut by max_tokens is not
a tool call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from common.chat_templates import implied_parser, shipped_template, tool_template_for
from common.messages import GrammarKind
from common.server_args import ServerArgs
from tests.tokenizer_proc.server_harness import Server
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.openai_protocol import chat_messages, parse_chat_request
from tokenizer_proc.tokenizer import NoChatTemplateError, load_tokenizer
from tokenizer_proc.tools import ToolChoice, check_tool_schemas, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]


def test_tool_choice_modes() -> None:
    assert tool_request({"messages": ASK}, "hermes") is None
    auto = tool_request({"tools": [WEATHER, TIME]}, "hermes")
    assert auto is not None and auto.choice is ToolChoice.AUTO and auto.parallel and auto.active
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}, "hermes").active is False
    named = tool_request({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}, "parallel_tool_calls": False}, "hermes")
    assert named.choice is ToolChoice.NAMED and [t.name for t in named.callable_tools()] == ["get_time"]
    assert not named.parallel
    grammar = named.grammar()
    assert grammar.kind is GrammarKind.STRUCTURAL_TAG
    fmt = json.loads(grammar.text)["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "get_time", "arguments": ']
    required = tool_request({"tools": [WEATHER, TIME], "tool_choice": "required"}, "hermes")
    assert json.loads(required.grammar().text)["format"]["at_least_one"]
    assert json.loads(auto.grammar().text)["format"]["type"] == "triggered_tags"


@pytest.mark.parametrize("body,expect", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not among the tools (get_weather)"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined with response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "cannot be combined with regex"),
    ({"tools": [WEATHER], "json_schema": "{}"}, "cannot be combined with json_schema"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tool 'f': parameters must describe an object"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
])
def test_bad_tool_requests_are_400s_that_say_why(body: dict[str, Any], expect: str) -> None:
    with pytest.raises(BadRequestError) as e:
        tool_request(body, "hermes")
    assert expect in str(e.value)


def test_tools_beside_a_grammar_are_fine_when_no_call_may_be_made() -> None:
    assert tool_request({"tools": [WEATHER], "tool_choice": "none", "regex": "a+"}, "hermes").active is False


def test_a_parameters_schema_that_does_not_compile_is_a_400_naming_the_tool() -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    req = tool_request({"tools": [WEATHER, bad]}, "hermes")
    with pytest.raises(BadRequestError) as e:
        asyncio.run(check_tool_schemas(req, ServerArgs(model_path="unused")))
    assert "tool 'broken': parameters is not a valid JSON schema" in str(e.value) and "strin" in str(e.value)


def test_history_tool_results_must_answer_an_earlier_call() -> None:
    msgs = chat_messages(HISTORY)
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[2] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "call_1", "name": "get_weather"}
    with pytest.raises(BadRequestError, match="'call_9' matches no earlier assistant tool call"):
        chat_messages(ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}])
    with pytest.raises(BadRequestError, match="arguments is not JSON"):
        chat_messages(ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])


# ---- the chat template ---------------------------------------------------------------------------


def test_a_chatml_model_without_tools_in_its_template_gets_the_shipped_one(hf_folder: Path) -> None:
    tok = load_tokenizer(str(hf_folder))
    assert tok.implied_tool_parser == "hermes"
    plain = tok.decode(tok.apply_chat_template(ASK), skip_special_tokens=False)
    assert "<tools>" not in plain  # no tools: the model's own template, unchanged
    text = tok.decode(tok.apply_chat_template(HISTORY and chat_messages(HISTORY), tools=[WEATHER]),
                      skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" + json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_handles_tools_is_used_as_it_is() -> None:
    own = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}[{{ tools | length }} tools]{% endif %}"
    assert tool_template_for(own) == own
    assert tool_template_for("{{ '[INST]' }}") is None  # no shipped template for this family
    assert implied_parser(shipped_template("chatml-tools")) == "hermes"
    assert implied_parser("{{ '<|python_tag|>' }}") == "llama3"


def test_a_model_with_no_tool_template_answers_tools_with_a_400(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    with pytest.raises(NoChatTemplateError, match="does not render tools"):
        tok.apply_chat_template(ASK, tools=[WEATHER])


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt(hf_folder: Path) -> None:
    from tests.tokenizer_proc.test_chat_template import info_for

    tok = load_tokenizer(str(hf_folder))
    info = msgspec.structs.replace(info_for(tok), context_len=4096)  # the tiny vocabulary spells the tools long
    none = parse_chat_request({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, tok, info)
    auto = parse_chat_request({"messages": ASK, "tools": [WEATHER]}, tok, info)
    assert none.specs[0].req.input_ids == tok.apply_chat_template(ASK) and none.tools is None
    assert none.specs[0].req.sampling_params.grammar is None
    assert len(auto.specs[0].req.input_ids) > len(none.specs[0].req.input_ids) and auto.tools is not None
    assert auto.specs[0].req.sampling_params.grammar.kind is GrammarKind.STRUCTURAL_TAG


# ---- the answer, through the app -------------------------------------------------------------------

RECORDED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def app(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder))
    # the tiny vocabulary spells the tools long
    srv = Server(tok, tmp_path_factory.mktemp("ipc"), context_len=4096)
    srv.fake.script = tok.encode(RECORDED)  # the "model" answers with the recorded calls
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(app: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def test_calls_are_returned_as_tool_calls_and_the_stream_adds_up_to_them(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    with client.chat.completions.stream(**args) as stream:
        chunks = []
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        acc = stream.current_completion_snapshot
    got = acc.choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]
    for chunk in chunks:  # no markup in any content delta; each call opens with its id, type and name
        delta = chunk.choices[0].delta if chunk.choices else None
        assert delta is None or "<tool" not in (delta.content or "")
        for tc in (delta.tool_calls or []) if delta else []:
            assert (tc.id is not None) == (tc.function.name is not None)


def test_a_call_cut_by_max_tokens_is_not_a_tool_call(app: Server, client: openai.OpenAI) -> None:
    cut_at = len(app.tokenizer.encode(RECORDED[:RECORDED.index("Europe")]))
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=cut_at)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]  # the complete one only
    assert choice.message.content == "Let me check."


def test_without_tools_the_same_text_is_plain_content(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="m", messages=ASK, max_tokens=200)
    assert whole.choices[0].message.content == RECORDED and whole.choices[0].finish_reason == "stop"


def test_a_shipped_template_is_taken_by_name_and_the_parser_flag_by_its_names(hf_folder: Path) -> None:
    args = ServerArgs(model_path="unused", chat_template="chatml-tools", tool_call_parser="llama3")
    tok = load_tokenizer(str(hf_folder), args.chat_template_text())
    text = tok.decode(tok.apply_chat_template(ASK), skip_special_tokens=False)
    assert text == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"  # no default system turn
    assert tok.implied_tool_parser == "hermes"  # what the template teaches; the flag wins over it
    req = tool_request({"tools": [WEATHER], "tool_choice": "required"}, args.tool_call_parser)
    assert req.parser.name == "llama3"
    assert json.loads(req.grammar().text)["format"]["tags"][0]["begin"] == '{"name": "get_weather", "parameters": '
    with pytest.raises(ValueError, match="--tool-call-parser 'xml': one of hermes, qwen25, llama3, mistral, pythonic"):
        ServerArgs(model_path="unused", tool_call_parser="xml")


def test_the_stream_has_openais_delta_shape(app: Server) -> None:
    from tests.tokenizer_proc.server_harness import post, sse_events

    status, _, raw = post(app, {"messages": ASK, "tools": [WEATHER, TIME], "stream": True, "max_tokens": 200},
                          "/v1/chat/completions")
    assert status == 200
    chunks = [e for e in sse_events(raw) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": None}
    entries = [tc for d in deltas for tc in d.get("tool_calls", [])]
    seen: set[int] = set()
    for tc in entries:
        if tc["index"] not in seen:  # a call's first delta: index, id, type, name, arguments so far
            seen.add(tc["index"])
            assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
            assert set(tc["function"]) == {"name", "arguments"}
        else:  # later: argument fragments only
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
    assert seen == {0, 1}
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_format_whose_trigger_is_a_special_token_keeps_special_tokens_in_the_text(hf_folder: Path) -> None:
    from tests.tokenizer_proc.test_chat_template import info_for
    from tokenizer_proc.openai_protocol import check_chat_request

    tok = load_tokenizer(str(hf_folder))
    info = msgspec.structs.replace(info_for(tok), context_len=4096)
    for parser, keeps in (("llama3", True), ("mistral", True), ("hermes", False)):
        pending = check_chat_request({"messages": ASK, "tools": [WEATHER]}, info, tool_parser=parser)
        sp = pending.finish(pending.encode(tok)).specs[0].req.sampling_params
        assert sp.skip_special_tokens is (not keeps) and sp.grammar.kind is GrammarKind.STRUCTURAL_TAG
    with pytest.raises(BadRequestError, match="--tool-call-parser"):  # a template that implies no format
        check_chat_request({"messages": ASK, "tools": [WEATHER]}, info, tool_parser=None)
