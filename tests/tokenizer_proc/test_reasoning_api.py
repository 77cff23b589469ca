"""Reasoning output and chat template options on /v1/chat/completions, with a
fake scheduler that "generates" a recorded reasoning model's text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.tokenizer_proc.server_harness import Server, post, sse_events
from tokenizer_proc.tokenizer import load_tokenizer

# Qwen3's way: an empty thinking block when enable_thinking is false; here the
# template opens the block itself otherwise (as DeepSeek-R1's and Qwen3-2507's do)
THINKING_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THOUGHT_AND_ANSWER = "The user says hi.\nI greet back.\n</think>\n\nHello there!"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = load_tokenizer(str(hf_folder), chat_template=THINKING_CHATML)
    srv = Server(tok, tmp_path_factory.mktemp("ipc"), reasoning_parser="qwen3")
    srv.fake.script = tok.encode(THOUGHT_AND_ANSWER)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def test_thinking_goes_to_reasoning_content_and_the_answer_to_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="test", messages=HI)
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == "The user says hi.\nI greet back.\n"


def test_streamed_thinking_never_reaches_content_and_adds_up(server: Server) -> None:
    status, _, body = post(server, {"messages": HI, "stream": True}, "/v1/chat/completions")
    assert status == 200
    reasoning, content = "", ""
    for ev in sse_events(body):
        delta = ev["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        assert "think>" not in delta.get("content", "") and "think>" not in delta.get("reasoning_content", "")
    assert (reasoning, content) == ("The user says hi.\nI greet back.\n", "Hello there!")


def test_separate_reasoning_false_leaves_the_text_whole(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="test", messages=HI, extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == THOUGHT_AND_ANSWER
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_chat_template_kwargs_reach_the_template(server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="test", messages=HI,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    client.chat.completions.create(model="test", messages=HI)
    prompt = server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_continue_final_message_ends_the_prompt_inside_the_assistant_message(
        server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="test", messages=HI + [{"role": "assistant", "content": "Hello, my"}],
                                   extra_body={"continue_final_message": True, "separate_reasoning": False})
    prompt = server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello, my")


@pytest.mark.parametrize("body,message", [
    ({"continue_final_message": True}, "last message to be the assistant's"),
    ({"chat_template_kwargs": {"tokenize": True}}, "cannot be a template variable"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "must be an object"),
    ({"separate_reasoning": "yes"}, "separate_reasoning must be a boolean"),
    ({"thinking_budget": -1}, "thinking_budget must be >= 0"),
])
def test_bad_chat_options_are_a_400_naming_the_field(server: Server, body: dict, message: str) -> None:
    status, _, raw = post(server, {"messages": HI, **body}, "/v1/chat/completions")
    assert status == 400 and message in json.loads(raw)["error"]["message"]


def test_thinking_budget_reaches_the_scheduler_with_the_closing_tag(server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="test", messages=HI, extra_body={"thinking_budget": 3})
    spec = server.fake.requests()[-1].thinking_budget
    assert spec is not None and spec.budget == 3
    assert spec.end_ids == server.tokenizer.encode("</think>", add_special_tokens=False)
    assert spec.start_id == -1  # the template opened the block: thinking from the first token


def test_thinking_budget_needs_the_opening_tag_as_one_token_when_the_model_opens_it(server: Server) -> None:
    # enable_thinking false: the prompt closes the block, so thinking could only open with <think>,
    # which this small tokenizer splits into several tokens
    status, _, raw = post(server, {"messages": HI, "thinking_budget": 3,
                                   "chat_template_kwargs": {"enable_thinking": False}}, "/v1/chat/completions")
    assert status == 400 and "<think> is not one token" in json.loads(raw)["error"]["message"]


def test_responses_put_the_thinking_in_a_reasoning_item_streamed_or_not(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="test", input="hi")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "The user says hi.\nI greet back.\n"
    assert whole.output_text == "Hello there!"
    events = list(client.responses.create(model="test", input="hi", stream=True))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, answer) == ("The user says hi.\nI greet back.\n", "Hello there!")
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == [0, 1] and done == ["reasoning", "message"]
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_anthropic_messages_put_the_thinking_in_a_thinking_block_streamed_or_not(server: Server) -> None:
    import anthropic

    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=10)
    whole = c.messages.create(model="test", max_tokens=100, messages=HI)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "The user says hi.\nI greet back.\n"), ("text", "Hello there!")]
    with c.messages.stream(model="test", max_tokens=100, messages=HI) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    c.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_keeps_the_answer_without_its_thinking(server: Server, client: openai.OpenAI,
                                                                 stream: bool) -> None:
    first = client.responses.create(model="test", input="hi", store=True, stream=stream)
    if stream:
        first = list(first)[-1].response
    client.responses.create(model="test", input="again", previous_response_id=first.id)
    prompt = server.tokenizer.decode(server.fake.requests()[-1].input_ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\nHello there!<|im_end|>\n<|im_start|>user\nagain" in prompt
