"""Every field of SGLang's GenerateReqInput and SamplingParams on /generate,
and OpenAI's and SGLang's extras on /v1/*: the request shapes SGLang's
bench_serving client sends are answered, a field this server cannot honour is
accepted at its null/default value and otherwise refused with a 400 naming it
and why, and the implemented ones reach the scheduler (HTTP app + fake
scheduler)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, post, sse_events
from tokenizer_proc.sglang_fields import (DEFAULT_ONLY, GENERATE_FIELDS, OPENAI_FIELDS, SAMPLING_FIELDS,
                                          markdown)

# SGLang's bench_serving, as it sends them (python/sglang/bench_serving.py,
# async_request_sglang_generate / openai_completions / openai_chat_completions),
# with its defaults: no LoRA, no logprobs, streaming, ignore_eos.
BENCH_SGLANG_GENERATE = {
    "text": "Hello, my name is",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    "stream": True,
    "lora_path": None,
    "return_logprob": False,
    "return_routed_experts": False,
    "logprob_start_len": -1,
}
BENCH_SGLANG_GENERATE_IDS = {**BENCH_SGLANG_GENERATE, "input_ids": [5, 6, 7, 8]}
del BENCH_SGLANG_GENERATE_IDS["text"]
BENCH_OPENAI_COMPLETIONS = {
    "model": "default", "prompt": "Hello, my name is", "best_of": 1, "max_tokens": 8, "stream": True,
    "temperature": 0.0, "ignore_eos": True,
}
BENCH_OPENAI_CHAT = {
    "model": "default", "messages": [{"role": "user", "content": "Hello, my name is"}],
    "max_completion_tokens": 8, "stream": True, "temperature": 0.0, "ignore_eos": True,
}
# what SGLang's router and gateway add to the bodies they forward
ROUTER_FIELDS = {
    "model": "smollm2", "log_metrics": True, "return_hidden_states": False, "background": False,
    "no_logs": True, "return_bytes": False, "return_entropy": False, "routed_dp_rank": 0,
    "data_parallel_rank": None, "priority": 3, "session_id": "s-1", "routing_key": "k",
    "custom_labels": {"team": "a"}, "conversation_id": "c", "received_time": 1.5e9,
    "external_trace_header": {"traceparent": "x"}, "kv_router_hint": None, "bootstrap_host": None,
    "bootstrap_room": None, "lora_id": None, "image_data": [], "modalities": None,
    "return_prompt_token_ids": False, "token_ids_logprob": None, "session_params": None,
    "custom_logit_processor": None, "input_embeds": None,
}


@pytest.mark.parametrize("body", [BENCH_SGLANG_GENERATE, BENCH_SGLANG_GENERATE_IDS,
                                  {**BENCH_SGLANG_GENERATE, "stream": False}],
                         ids=["text", "input_ids", "not-streamed"])
def test_sglang_bench_serving_generate_body_is_answered(server: Server, body: dict) -> None:
    status, _, raw = post(server, body)
    assert status == 200, raw
    last = sse_events(raw)[-1] if body["stream"] else json.loads(raw)
    assert last["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert server.fake.requests()[-1].sampling_params.ignore_eos


@pytest.mark.parametrize("path,body", [("/v1/completions", BENCH_OPENAI_COMPLETIONS),
                                       ("/v1/chat/completions", BENCH_OPENAI_CHAT)],
                         ids=["completions", "chat"])
def test_sglang_bench_serving_openai_bodies_are_answered(server: Server, path: str, body: dict) -> None:
    status, _, raw = post(server, body, path)
    assert status == 200, raw
    assert sse_events(raw)[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_router_fields_at_their_defaults_are_accepted(server: Server) -> None:
    status, _, raw = post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                   **ROUTER_FIELDS})
    assert status == 200, raw


def test_every_sglang_field_at_null_is_accepted(server: Server) -> None:
    body: dict[str, Any] = {name: None for name in GENERATE_FIELDS}
    body["text"] = "hi"
    body["sampling_params"] = {name: None for name in SAMPLING_FIELDS}
    status, _, raw = post(server, body)
    assert status == 200, raw
    assert server.fake.requests()[-1].sampling_params.max_new_tokens == 128  # defaults


def _non_default(name: str, accepted: tuple) -> Any:
    """A value the field cannot take here: of the type its default has, else a string."""
    if any(isinstance(a, bool) for a in accepted):
        return True
    if any(isinstance(a, int) for a in accepted):
        return 5
    return {"type": "json_object"} if name == "response_format" else "x"


REFUSED_GENERATE = [(n, r) for n, r in GENERATE_FIELDS.items() if r.status == DEFAULT_ONLY]
REFUSED_SAMPLING = [(n, r) for n, r in SAMPLING_FIELDS.items() if r.status == DEFAULT_ONLY]
REFUSED_OPENAI = [(n, r) for n, r in OPENAI_FIELDS.items() if r.status == DEFAULT_ONLY]


def _assert_refused(server: Server, body: Any, path: str, name: str, reason: str) -> None:
    before = len(server.fake.requests())
    status, _, raw = post(server, body, path)
    assert status == 400, (name, raw)
    message = json.loads(raw)["error"]["message"]
    assert name in message and reason in message, message
    assert len(server.fake.requests()) == before  # nothing reached the scheduler


@pytest.mark.parametrize("name,rule", REFUSED_GENERATE, ids=[n for n, _ in REFUSED_GENERATE])
def test_a_generate_field_we_cannot_honour_is_a_400_naming_it(server: Server, name, rule) -> None:
    _assert_refused(server, {"text": "hi", name: _non_default(name, rule.accepted)}, "/generate",
                    name, rule.reason)


@pytest.mark.parametrize("name,rule", REFUSED_SAMPLING, ids=[n for n, _ in REFUSED_SAMPLING])
def test_a_sampling_field_we_cannot_honour_is_a_400_naming_it(server: Server, name, rule) -> None:
    value = False if name == "spaces_between_special_tokens" else _non_default(name, rule.accepted)
    _assert_refused(server, {"text": "hi", "sampling_params": {name: value}}, "/generate",
                    f"sampling_params.{name}", rule.reason)


@pytest.mark.parametrize("name,rule", REFUSED_OPENAI, ids=[n for n, _ in REFUSED_OPENAI])
def test_an_openai_field_we_cannot_honour_is_a_400_naming_it(server: Server, name, rule) -> None:
    body = {"prompt": "hi", "max_tokens": 2, name: _non_default(name, rule.accepted)}
    _assert_refused(server, body, "/v1/completions", name, rule.reason)
    chat = {"messages": [{"role": "user", "content": "hi"}], name: _non_default(name, rule.accepted)}
    _assert_refused(server, chat, "/v1/chat/completions", name, rule.reason)


@pytest.mark.parametrize("body,reason", [
    ({"text": "hi", "lora_path": "x"}, "LoRA adapters are not supported"),
    ({"text": "hi", "lora_path": ["a", None]}, "LoRA adapters are not supported"),
    ({"text": "hi", "image_data": "http://x/y.png"}, "this server serves text models"),
    ({"text": "hi", "return_hidden_states": True}, "hidden states are not returned"),
    ({"text": "hi", "routed_dp_rank": 1}, "one data-parallel rank"),
    ({"text": "hi", "sampling_params": {"structural_tag": "{}"}}, "structural tags are not supported"),
    ({"text": "hi", "sampling_params": {"json_schema": "{}", "regex": "a"}}, "mutually exclusive"),
    ({"text": "hi", "sampling_params": {"regex": "(a"}}, "invalid regex"),
    ({"text": "hi", "sampling_params": {"json_schema": '{"type": "objekt"}'}}, "invalid json_schema"),
    ({"text": "hi", "sampling_params": {"ebnf": "root ::= "}}, "invalid ebnf"),
    ({"text": "hi", "sampling_params": {"regex": "a", "min_new_tokens": 1}}, "cannot be combined with a grammar"),
], ids=["lora", "lora-list", "image", "hidden", "dp-rank", "structural_tag", "two-grammars", "bad-regex",
        "bad-schema", "bad-ebnf", "min_new_tokens"])
def test_refusals_say_why(server: Server, body: dict, reason: str) -> None:
    status, _, raw = post(server, body)
    assert status == 400 and reason in json.loads(raw)["error"]["message"]


def test_names_sglang_does_not_define_are_400s_on_generate_and_ignored_on_openai(server: Server) -> None:
    for body, name in (({"text": "hi", "frobnicate": 1}, "frobnicate"),
                       ({"text": "hi", "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate")):
        status, _, raw = post(server, body)
        message = json.loads(raw)["error"]["message"]
        assert status == 400 and name in message and "SGLang" in message
    status, _, _ = post(server, {"prompt": "hi", "max_tokens": 2, "frobnicate": 1}, "/v1/completions")
    assert status == 200


def test_implemented_sampling_fields_reach_the_scheduler(server: Server) -> None:
    status, _, raw = post(server, {"text": "hi", "extra_key": "tenant-b", "sampling_params": {
        "max_new_tokens": 5, "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.2,
        "min_new_tokens": 3, "logit_bias": {"7": 2.5, "11": -100}, "sampling_seed": 42, "stream_interval": 2}})
    assert status == 200, raw
    req = server.fake.requests()[-1]
    sp = req.sampling_params
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.2)
    assert sp.min_new_tokens == 3 and sp.logit_bias == {7: 2.5, 11: -100.0}
    assert sp.seed == 42 and sp.stream_interval == 2
    assert "tenant-b" in req.cache_salt  # its own cache namespace


def test_openai_extras_reach_the_scheduler(server: Server) -> None:
    status, _, raw = post(server, {"prompt": "hi", "max_tokens": 5, "frequency_penalty": 1.0,
                                   "presence_penalty": 0.5, "logit_bias": {"3": -100},
                                   "repetition_penalty": 1.1, "min_tokens": 2}, "/v1/completions")
    assert status == 200, raw
    sp = server.fake.requests()[-1].sampling_params
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (1.0, 0.5, 1.1)
    assert sp.logit_bias == {3: -100.0} and sp.min_new_tokens == 2
    status, _, raw = post(server, {"messages": [{"role": "user", "content": "hi"}], "input_ids": [5, 6, 7],
                                   "max_tokens": 2}, "/v1/chat/completions")
    assert status == 200 and server.fake.requests()[-1].input_ids == [5, 6, 7]


@pytest.mark.parametrize("path,body,expect", [
    ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty must be in [-2, 2]"),
    ("/generate", {"text": "hi", "sampling_params": {"presence_penalty": -2.1}}, "presence_penalty must be in [-2, 2]"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in (0, 2]"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 2.5}}, "repetition_penalty"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
     "min_new_tokens must be in [0, max_new_tokens]"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": -1}}, "min_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"999999": 1}}}, "logit_bias: token ids"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"a": 1}}}, "not a token id"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": [1]}}, "logit_bias must be an object"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"3": 1e300}}}, "must be in [-1e+09, 1e+09]"),
    ("/generate", {"text": "hi", "sampling_params": {"stream_interval": 0}}, "stream_interval"),
    # integers beyond int64 are 400s, not a failure to encode the request for the scheduler
    ("/generate", {"text": "hi", "sampling_params": {"stream_interval": 2**64}}, "stream_interval"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 2**64}}, "min_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {str(10**30): 1}}}, "logit_bias: token ids"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**64}, "min_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 1, "sampling_seed": 2}}, "differ"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "("}}, "not a valid regular expression"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "a*"}}, "matches the empty string"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "one object per prompt"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "n must be the same"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"3": 101}}, "logit_bias['3'] must be in [-100, 100]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4},
     "min_tokens must be in [0, max_tokens]"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None)
def test_penalties_out_of_range_are_400s(server: Server, path: str, body: dict, expect: str) -> None:
    status, _, raw = post(server, body, path)
    assert status == 400 and expect in json.loads(raw)["error"]["message"], raw


def test_a_list_of_sampling_params_gives_each_prompt_its_own(server: Server) -> None:
    status, _, raw = post(server, {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2}, {"max_new_tokens": 3, "frequency_penalty": 1.0}]})
    assert status == 200, raw
    a, b = server.fake.requests()[-2:]
    assert (a.sampling_params.max_new_tokens, b.sampling_params.max_new_tokens) == (2, 3)
    assert b.sampling_params.frequency_penalty == 1.0 and a.sampling_params.frequency_penalty == 0.0


# ---- stops: no_stop_trim and stop_regex, on the fake scheduler's script (TEXT) ----------


def test_no_stop_trim_keeps_the_matched_stop_string(server: Server) -> None:
    stop = "wörld"
    for trim, expect in ((False, TEXT[:TEXT.index(stop)]), (True, TEXT[:TEXT.index(stop) + len(stop)])):
        status, _, raw = post(server, {"text": "hi", "sampling_params": {"stop": stop, "no_stop_trim": trim}})
        out = json.loads(raw)
        assert status == 200 and out["text"] == expect
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_no_stop_trim_keeps_the_text_of_the_stop_token(server: Server) -> None:
    """The fake scheduler ends a long request on EOS ({"type": "stop", "matched": eos})."""
    eos_text = server.tokenizer.decode([server.eos], skip_special_tokens=False)
    texts = {}
    for trim in (False, True):
        status, _, raw = post(server, {"text": "hi", "sampling_params": {
            "max_new_tokens": 200, "skip_special_tokens": False, "no_stop_trim": trim}})
        out = json.loads(raw)
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": server.eos}
        texts[trim] = out["text"]
    assert eos_text and texts[False] == TEXT and texts[True] == TEXT + eos_text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_regex_cuts_the_text_before_its_match(server: Server, stream: bool) -> None:
    status, _, raw = post(server, {"text": "hi", "stream": stream, "sampling_params": {
        "stop_regex": [r"w\wrld", "never"]}})
    assert status == 200
    events = sse_events(raw) if stream else [json.loads(raw)]
    assert events[-1]["text"] == TEXT[:TEXT.index("wörld")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"w\wrld"}
    for e in events:  # never a part of the match, at any point
        assert events[-1]["text"].startswith(e["text"])
    status, _, raw = post(server, {"prompt": "hi", "max_tokens": 100, "stop_regex": r"\d|世.",
                                   "no_stop_trim": True}, "/v1/completions")
    choice = json.loads(raw)["choices"][0]
    assert choice["text"] == TEXT[:TEXT.index("世界") + 2] and choice["finish_reason"] == "stop"


def test_readme_lists_the_fields_as_the_tables_say() -> None:
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    assert markdown() in readme, "README.md: paste `python -m tokenizer_proc.sglang_fields`"
