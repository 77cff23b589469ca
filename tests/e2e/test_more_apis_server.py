"""End to end, the real default model (SmolLM2-135M) behind the other APIs:
OpenAI's Responses API and Anthropic's Messages API (each client's streamed
answer adds up to its unstreamed one), /tokenize and /detokenize with the
real tokenizer, SGLang's /v1/score against /generate's token_ids_logprob, and
chat's continue_final_message, and a thinking budget forced by the scheduler.
One server for the module, few tokens."""

from __future__ import annotations

import math
from collections.abc import Iterator

import anthropic
import openai
import pytest
import requests

from tests.e2e.server_process import ServerProcess

QUESTION = "What is the capital of France? Answer in one sentence."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(shared_float32_server: ServerProcess) -> ServerProcess:
    # the session's shared server (tests/conftest.py), with what this module needs:
    # float32: /v1/score is compared with /generate to the last digits, whatever the batch.
    # qwen3's parser splits only an output that opens a thinking block (SmolLM2's never
    # does) or one whose prompt opened it: the other tests' answers are all content
    return shared_float32_server


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def post(server: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def test_responses_stream_adds_up_to_the_unstreamed_response(oai: openai.OpenAI) -> None:
    args = dict(model="default", input=QUESTION, instructions="Be brief.", max_output_tokens=12, **GREEDY)
    whole = oai.responses.create(**args)
    assert whole.status == "completed" and 0 < whole.usage.output_tokens <= 12
    events = list(oai.responses.create(**args, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    short = oai.responses.create(**{**args, "max_output_tokens": 2})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert "Paris" in whole.output_text


def test_anthropic_stream_adds_up_to_the_unstreamed_message(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    args = dict(model="default", max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": QUESTION}],
                extra_body=GREEDY)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert whole.content[0].text == final.content[0].text and "Paris" in whole.content[0].text
    assert whole.stop_reason == final.stop_reason == "end_turn"
    count = client.messages.count_tokens(model="default", system="Be brief.",
                                         messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == whole.usage.input_tokens
    client.close()


def test_tokenize_and_detokenize_round_trip_with_the_real_tokenizer(server: ServerProcess) -> None:
    r = post(server, "/tokenize", {"prompt": "Hello, world!"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["text"] == "Hello, world!"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]}).json()
    text = post(server, "/detokenize", {"tokens": chat["tokens"], "skip_special_tokens": False}).json()["prompt"]
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def test_score_equals_the_next_token_logprobs_of_generate(server: ServerProcess) -> None:
    yes, no = (post(server, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
               for w in (" yes", " no"))
    query = "Question: is Paris in France? Answer:"
    r = post(server, "/v1/score", {"query": "Question: is ", "items": ["Paris in France? Answer:"],
                                   "label_token_ids": [yes, no]})
    assert r.status_code == 200, r.text
    gen = post(server, "/generate", {"text": query, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                     "return_logprob": True, "token_ids_logprob": [yes, no]}).json()
    want = [math.exp(lp) for lp, _, _ in gen["meta_info"]["output_token_ids_logprobs"][0]]
    assert r.json()["scores"][0] == pytest.approx(want, rel=1e-4)
    soft = post(server, "/v1/score", {"query": "Question: is ", "items": ["Paris in France? Answer:"],
                                      "label_token_ids": [yes, no], "apply_softmax": True}).json()["scores"][0]
    assert soft == pytest.approx([w / sum(want) for w in want], rel=1e-3)


def test_continue_final_message_completes_the_assistant_text(server: ServerProcess, oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital of France"}]
    r = oai.chat.completions.create(model="default", messages=messages, max_tokens=4,
                                    extra_body={"continue_final_message": True}, **GREEDY)
    prompt = post(server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                        "add_generation_prompt": False}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": prompt, "skip_special_tokens": False}).json()["text"]
    assert text.endswith("<|im_start|>assistant\nThe capital of France")
    same = oai.completions.create(model="default", prompt=prompt, max_tokens=4, **GREEDY)
    assert r.choices[0].message.content == same.choices[0].text and r.choices[0].message.content.strip()


def test_bad_requests_on_the_new_routes_leave_a_stream_in_flight_untouched(server: ServerProcess,
                                                                           oai: openai.OpenAI) -> None:
    args = dict(model="default", input=QUESTION, max_output_tokens=12, **GREEDY)
    want = oai.responses.create(**args).output_text
    stream = oai.responses.create(**args, stream=True)
    deltas = [next(stream)]  # response.created: the request is in flight
    for path, body in (("/v1/responses", {"input": []}), ("/v1/messages", {"messages": [], "max_tokens": 5}),
                       ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10**9]}),
                       ("/tokenize", {"prompt": 5}), ("/v1/chat/completions", {
                           "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True})):
        assert post(server, path, body).status_code == 400, path
    deltas += list(stream)
    assert "".join(e.delta for e in deltas if e.type == "response.output_text.delta") == want


def test_a_thinking_budget_closes_the_block_after_that_many_tokens(oai: openai.OpenAI) -> None:
    # the assistant's turn opened with <think>: the output is thinking until </think>
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<think>\n"}]
    args = dict(model="default", messages=messages, max_tokens=12, **GREEDY)
    free = oai.chat.completions.create(**args, extra_body={"continue_final_message": True})
    thought = free.choices[0].message.model_extra["reasoning_content"]
    assert thought and free.choices[0].message.content == ""  # never closed: all reasoning
    cut = oai.chat.completions.create(**args, extra_body={"continue_final_message": True, "thinking_budget": 3})
    msg = cut.choices[0].message
    assert msg.model_extra["reasoning_content"] and thought.startswith(msg.model_extra["reasoning_content"])
    assert msg.model_extra["reasoning_content"] != thought and msg.content  # forced to answer
    raw = oai.chat.completions.create(**args, extra_body={"continue_final_message": True, "thinking_budget": 3,
                                                          "separate_reasoning": False})
    assert raw.choices[0].message.content.startswith(msg.model_extra["reasoning_content"] + "</think>")
