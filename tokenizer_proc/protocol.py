"""Parsing and validating a native `/generate` request body.

Everything a client can get wrong is caught here and raised as
`BadRequestError`, which the HTTP layer turns into a 400; nothing invalid
ever reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from common.messages import SamplingParams
from tokenizer_proc.tokenizer import Tokenizer


class BadRequestError(Exception):
    """A client error; its message is shown to the client."""


@dataclass
class GenerateInput:
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    rid: str | None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequestError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


# ---- type checks: each returns the value or raises --------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def _int(name: str, v: Any) -> int:
    if not _is_int(v):
        raise BadRequestError(f"{name} must be an integer")
    return v


def _number(name: str, v: Any) -> float:
    if not (_is_int(v) or isinstance(v, float)):
        raise BadRequestError(f"{name} must be a number")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequestError(f"{name} must be a boolean")
    return v


def _int_list(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise BadRequestError(f"{name} must be a list of integers")
    return v


_SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": _int,
    "temperature": _number,
    "top_p": _number,
    "top_k": _int,
    "min_p": _number,
    "stop_token_ids": _int_list,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "seed": _int,
}

# Accepted so SGLang's own clients work; logprobs are not implemented yet, so
# they are only accepted while they ask for nothing.
_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs")
_TOP_LEVEL_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid", *_LOGPROB_FIELDS}


def parse_sampling_params(obj: Any) -> SamplingParams:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise BadRequestError("sampling_params must be a JSON object")
    unknown = sorted(set(obj) - set(_SAMPLING_FIELDS))
    if unknown:
        raise BadRequestError(f"unsupported sampling_params: {', '.join(unknown)}")
    # null means "the default", as in SGLang's Python clients.
    kwargs = {k: _SAMPLING_FIELDS[k](f"sampling_params.{k}", v) for k, v in obj.items() if v is not None}
    sp = SamplingParams(**kwargs)
    if sp.max_new_tokens < 1:
        raise BadRequestError("sampling_params.max_new_tokens must be >= 1")
    if sp.temperature < 0:
        raise BadRequestError("sampling_params.temperature must be >= 0")
    if not 0 < sp.top_p <= 1:
        raise BadRequestError("sampling_params.top_p must be in (0, 1]")
    if sp.top_k < -1:
        raise BadRequestError("sampling_params.top_k must be -1 (off) or >= 1")
    if sp.top_k == 0:
        sp.top_k = -1  # 0 also means "off"
    if not 0 <= sp.min_p <= 1:
        raise BadRequestError("sampling_params.min_p must be in [0, 1]")
    if any(i < 0 for i in sp.stop_token_ids):
        raise BadRequestError("sampling_params.stop_token_ids must be >= 0")
    return sp


def _prompt_ids(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequestError("exactly one of text or input_ids must be given")
    if text is not None:
        if isinstance(text, list):
            raise BadRequestError("batched requests (a list of texts) are not supported yet")
        if not isinstance(text, str):
            raise BadRequestError("text must be a string")
        ids = tokenizer.encode(text) if text else []
    else:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            raise BadRequestError("batched requests (a list of input_ids lists) are not supported yet")
        ids = _int_list("input_ids", input_ids)
    if not ids:
        raise BadRequestError("the prompt is empty")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"token id {bad} is out of range [0, {vocab_size})")
    return ids


def parse_generate_request(
    body: dict[str, Any], tokenizer: Tokenizer, context_len: int, vocab_size: int
) -> GenerateInput:
    unknown = sorted(set(body) - _TOP_LEVEL_FIELDS)
    if unknown:
        raise BadRequestError(f"unsupported fields: {', '.join(unknown)}")
    if body.get("return_logprob") not in (None, False):
        raise BadRequestError("return_logprob is not supported yet")
    stream = body.get("stream")
    stream = False if stream is None else _bool("stream", stream)
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise BadRequestError("rid must be a non-empty string")
    sp = parse_sampling_params(body.get("sampling_params"))
    ids = _prompt_ids(body, tokenizer, vocab_size)
    if len(ids) >= context_len:
        raise BadRequestError(
            f"the input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_len} tokens)")
    if len(ids) + sp.max_new_tokens > context_len:
        raise BadRequestError(
            f"requested {len(ids)} prompt tokens + {sp.max_new_tokens} max_new_tokens = "
            f"{len(ids) + sp.max_new_tokens} tokens, more than the model's context length "
            f"({context_len} tokens)")
    return GenerateInput(input_ids=ids, sampling_params=sp, stream=stream, rid=rid)
