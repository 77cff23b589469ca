"""Bad input that used to be a 500 with a traceback is a 400 naming the field:
JSON nested deeper than Python's recursion on every route that reads a body,
an integer too large for a float in every float field, a token-id key that
passes str.isdigit() but is no integer, and the same in /timeline's query."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.tokenizer_proc.server_harness import Server, get, post, request
from tokenizer_proc.validation import MAX_JSON_DEPTH

BODY_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
HUGE_INT = int("9" * 400)  # no float holds it: float() raises OverflowError


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def error_of(status: int, body: bytes) -> str:
    assert status == 400, (status, body[:300])
    return json.loads(body)["error"]["message"]


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
def test_deeply_nested_json_is_a_400_on_every_route(server: Server, path: str, depth: int) -> None:
    for raw in (nested(depth), '{"a":' * depth + "1" + "}" * depth,
                '{"text": "hi", "rid": ' + nested(depth) + "}"):
        message = error_of(*request(server, "POST", path, raw.encode())[::2])
        assert "nested" in message and str(MAX_JSON_DEPTH) in message, message


def test_json_nested_within_the_bound_still_parses(server: Server) -> None:
    # a field nested MAX_JSON_DEPTH deep (the body object is the first level)
    # gets past decoding, to the field's own check
    raw = '{"text": "hi", "rid": ' + nested(MAX_JSON_DEPTH - 1) + "}"
    message = error_of(*request(server, "POST", "/generate", raw.encode())[::2])
    assert "rid must be" in message


GENERATE_FLOATS = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty"]
OPENAI_FLOATS = ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "timeout"]


def generate_body(**sampling: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": 2, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize("field", GENERATE_FLOATS)
def test_a_huge_integer_in_a_generate_float_field_is_a_400(server: Server, field: str) -> None:
    message = error_of(*post(server, generate_body(**{field: HUGE_INT}))[::2])
    assert f"sampling_params.{field}" in message, message


def test_a_huge_integer_as_the_timeout_is_a_400(server: Server) -> None:
    message = error_of(*post(server, {**generate_body(), "timeout": HUGE_INT})[::2])
    assert "timeout" in message, message


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", OPENAI_FLOATS)
def test_a_huge_integer_in_an_openai_float_field_is_a_400(server: Server, path: str, field: str) -> None:
    body = (completion_body if path == "/v1/completions" else chat_body)(**{field: HUGE_INT})
    message = error_of(*post(server, body, path)[::2])
    assert field in message, message


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "1" * 400, "1" * 5000, ""])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(server: Server, key: str) -> None:
    for path, body in (("/generate", generate_body(logit_bias={key: 1.0})),
                       ("/v1/completions", completion_body(logit_bias={key: 1.0})),
                       ("/v1/chat/completions", chat_body(logit_bias={key: 1.0}))):
        message = error_of(*post(server, body, path)[::2])
        assert "logit_bias" in message, (path, message)


def test_a_huge_integer_as_a_logit_bias_value_is_a_400(server: Server) -> None:
    message = error_of(*post(server, generate_body(logit_bias={"5": HUGE_INT}))[::2])
    assert "logit_bias" in message, message


@pytest.mark.parametrize("name", ["limit", "after_seq"])
@pytest.mark.parametrize("value", ["%C2%B2", "%D9%A1", "1" * 400, "-1", "1.5"])
def test_timeline_query_that_is_no_integer_is_a_400(server: Server, name: str, value: str) -> None:
    message = error_of(*get(server, f"/timeline?{name}={value}")[::2])
    assert name in message, message
