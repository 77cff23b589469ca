"""/tokenize and /detokenize in the shape SGLang's and vLLM's clients read."""

from __future__ import annotations

import json

import pytest

from tests.tokenizer_proc.server_harness import CONTEXT_LEN, Server, post

HI = [{"role": "user", "content": "hi"}]


def call(server: Server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = post(server, body, path)
    return status, json.loads(raw)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_a_prompt_gives_its_ids_count_and_the_context(server: Server, path: str) -> None:
    status, r = call(server, path, {"model": "test", "prompt": "hello world"})
    want = server.tokenizer.encode("hello world")
    assert status == 200 and r == {"tokens": want, "count": len(want), "max_model_len": CONTEXT_LEN}


def test_tokenize_without_special_tokens_drops_the_bos(server: Server) -> None:
    _, r = call(server, "/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert r["tokens"] == server.tokenizer.encode("hello")[1:]  # the SentencePiece model adds BOS


def test_tokenize_a_list_of_prompts_gives_a_list_per_prompt(server: Server) -> None:
    _, r = call(server, "/tokenize", {"prompt": ["a b", "hello world"], "return_token_strs": True})
    assert r["tokens"] == [server.tokenizer.encode("a b"), server.tokenizer.encode("hello world")]
    assert r["count"] == [len(t) for t in r["tokens"]]
    assert len(r["token_strs"]) == 2 and len(r["token_strs"][1]) == r["count"][1]


def test_tokenize_messages_gives_the_chat_prompt_ids(server: Server) -> None:
    _, r = call(server, "/tokenize", {"messages": HI})
    assert r["tokens"] == server.tokenizer.apply_chat_template(HI) and r["count"] == len(r["tokens"])


def test_detokenize_answers_text_and_prompt(server: Server) -> None:
    ids = server.tokenizer.encode("hello world")
    status, r = call(server, "/detokenize", {"tokens": ids})
    assert status == 200 and r == {"text": "hello world", "prompt": "hello world"}
    _, r = call(server, "/v1/detokenize", {"tokens": [ids, ids[:2]]})
    assert r["text"] == ["hello world", server.tokenizer.decode(ids[:2])]


@pytest.mark.parametrize("path,body,message", [
    ("/tokenize", {}, "exactly one of prompt"),
    ("/tokenize", {"prompt": 3}, "prompt must be a string"),
    ("/tokenize", {"messages": []}, "messages must be a non-empty list"),
    ("/detokenize", {"tokens": "12"}, "tokens must be a list"),
    ("/detokenize", {"tokens": [1, 10**9]}, "out of range"),
    ("/detokenize", {"tokens": [[1], ["x"]]}, "tokens[1] must be a list of integer token ids"),
])
def test_bad_tokenize_requests_are_a_400(server: Server, path: str, body: dict, message: str) -> None:
    status, r = call(server, path, body)
    assert status == 400 and message in r["error"]["message"]
