"""Parsing and validating a native `/generate` request body.

Everything a client can get wrong is caught here and raised as
`BadRequestError`, which the HTTP layer turns into a 400; nothing invalid
ever reaches the scheduler. One body becomes one `RequestSpec` per output:
a list of prompts and `n` samples fan out into len(prompts) * n requests,
prompt-major (all samples of prompt 0 first), which is the answer's order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from common.messages import SamplingParams
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.request_spec import RequestSpec, fan_out_rids, seed_for_sample
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import (check_bool, check_cache_salt, check_int, check_int_list, check_number,
                                       check_stop, is_int, optional, parse_json_object)

__all__ = ["BadRequestError", "GenerateInput", "parse_generate_request", "parse_json_object",
           "parse_sampling_params", "check_prompt_ids", "check_fits_context"]

MAX_N = 128  # samples of one prompt
# Bounds that keep every value inside the int64 tensors of the scheduler and the
# model (sample k of n gets seed + k, so a seed leaves room for that).
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1 - MAX_N
MAX_TOKEN_ID = 2**31 - 1
MAX_OUTPUTS = 1024  # requests one body may fan out into
MAX_TOP_LOGPROBS = 100


@dataclass
class GenerateInput:
    specs: list[RequestSpec]
    stream: bool
    batched: bool  # the answer is a JSON list (a list of prompts, or n > 1)
    return_text_in_logprobs: bool


_SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": check_int,
    "temperature": check_number,
    "top_p": check_number,
    "top_k": check_int,
    "min_p": check_number,
    "stop_token_ids": check_int_list,
    "ignore_eos": check_bool,
    "skip_special_tokens": check_bool,
    "seed": check_int,
}
# Handled here rather than by the scheduler, so not part of SamplingParams.
_LOCAL_SAMPLING_FIELDS = ("stop", "n")

_TOP_LEVEL_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
                     "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "cache_salt"}


def parse_sampling_params(obj: Any) -> SamplingParams:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise BadRequestError("sampling_params must be a JSON object")
    obj = {k: v for k, v in obj.items() if k not in _LOCAL_SAMPLING_FIELDS}
    unknown = sorted(set(obj) - set(_SAMPLING_FIELDS))
    if unknown:
        raise BadRequestError(f"unsupported sampling_params: {', '.join(unknown)}")
    # null means "the default", as in SGLang's Python clients.
    kwargs = {k: _SAMPLING_FIELDS[k](f"sampling_params.{k}", v) for k, v in obj.items() if v is not None}
    sp = SamplingParams(**kwargs)
    validate_sampling_params(sp, "sampling_params.")
    return sp


def validate_sampling_params(sp: SamplingParams, prefix: str = "") -> None:
    """Range checks; `prefix` names the fields as the client spelled them."""
    if sp.max_new_tokens < 1:
        raise BadRequestError(f"{prefix}max_new_tokens must be >= 1")
    if sp.temperature < 0:
        raise BadRequestError(f"{prefix}temperature must be >= 0")
    if not 0 < sp.top_p <= 1:
        raise BadRequestError(f"{prefix}top_p must be in (0, 1]")
    if not -1 <= sp.top_k <= MAX_TOP_K:
        raise BadRequestError(f"{prefix}top_k must be -1 or 0 (both: off), or in [1, {MAX_TOP_K}]")
    if sp.seed is not None and not 0 <= sp.seed <= MAX_SEED:
        raise BadRequestError(f"{prefix}seed must be in [0, {MAX_SEED}]")
    if sp.top_k == 0:
        sp.top_k = -1  # 0 also means "off"
    if not 0 <= sp.min_p <= 1:
        raise BadRequestError(f"{prefix}min_p must be in [0, 1]")
    if any(not 0 <= i <= MAX_TOKEN_ID for i in sp.stop_token_ids):
        raise BadRequestError(f"{prefix}stop_token_ids must be in [0, {MAX_TOKEN_ID}]")


def check_prompt_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise BadRequestError("the prompt is empty")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"token id {bad} is out of range [0, {vocab_size})")
    return ids


def check_fits_context(n_prompt: int, max_new_tokens: int, context_len: int,
                       max_new_name: str = "max_new_tokens") -> None:
    if n_prompt >= context_len:
        raise BadRequestError(
            f"the input ({n_prompt} tokens) must be shorter than the model's context length "
            f"({context_len} tokens), to leave room for at least one new token")
    if n_prompt + max_new_tokens > context_len:
        raise BadRequestError(
            f"requested {n_prompt} prompt tokens + {max_new_tokens} {max_new_name} = "
            f"{n_prompt + max_new_tokens} tokens, more than the model's context length "
            f"({context_len} tokens)")


def _prompts(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body held a list of prompts."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequestError("exactly one of text or input_ids must be given")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequestError("text must be a string or a list of strings")
        prompts = [tokenizer.encode(t) if t else [] for t in texts]
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        lists = input_ids if batched else [input_ids]
        prompts = [check_int_list("input_ids", ids) for ids in lists]
    if not prompts:
        raise BadRequestError("the list of prompts is empty")
    return [check_prompt_ids(ids, vocab_size) for ids in prompts], batched


def _client_rids(rid: Any, n_prompts: int, batched: bool) -> list[str]:
    """One base rid per prompt: the client's (a string, or a list with one per
    prompt) or a fresh one."""
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if n_prompts == 1 else [f"{base}-{p}" for p in range(n_prompts)]
    if isinstance(rid, str) and rid:
        return [rid] if n_prompts == 1 else [f"{rid}-{p}" for p in range(n_prompts)]
    if isinstance(rid, list) and batched:
        if len(rid) != n_prompts or not all(isinstance(r, str) and r for r in rid):
            raise BadRequestError("rid must be a list of non-empty strings, one per prompt")
        return rid
    raise BadRequestError("rid must be a non-empty string" + (" or a list of them" if batched else ""))


def parse_generate_request(
    body: dict[str, Any], tokenizer: Tokenizer, context_len: int, vocab_size: int
) -> GenerateInput:
    unknown = sorted(set(body) - _TOP_LEVEL_FIELDS)
    if unknown:
        raise BadRequestError(f"unsupported fields: {', '.join(unknown)}")
    stream = optional(body, "stream", check_bool, False)
    return_logprob = optional(body, "return_logprob", check_bool, False)
    top_n = optional(body, "top_logprobs_num", check_int, 0)
    if not 0 <= top_n <= min(MAX_TOP_LOGPROBS, vocab_size):
        raise BadRequestError(f"top_logprobs_num must be in [0, {min(MAX_TOP_LOGPROBS, vocab_size)}]")
    start_len = body.get("logprob_start_len")
    if start_len is not None and not (is_int(start_len) and start_len == -1):
        raise BadRequestError("logprob_start_len: input logprobs are not supported (use -1 or omit it)")
    text_in_logprobs = optional(body, "return_text_in_logprobs", check_bool, False)
    cache_salt = optional(body, "cache_salt", check_cache_salt, "")

    sp = parse_sampling_params(body.get("sampling_params"))
    raw_sp = body.get("sampling_params") or {}
    stop = optional(raw_sp, "stop", lambda k, v: check_stop(f"sampling_params.{k}", v), [])
    n = optional(raw_sp, "n", lambda k, v: check_int(f"sampling_params.{k}", v), 1)
    if not 1 <= n <= MAX_N:
        raise BadRequestError(f"sampling_params.n must be in [1, {MAX_N}]")

    prompts, batched = _prompts(body, tokenizer, vocab_size)
    for ids in prompts:
        check_fits_context(len(ids), sp.max_new_tokens, context_len)
    if len(prompts) * n > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} outputs per request (prompts x n)")
    batched = batched or n > 1
    bases = _client_rids(body.get("rid"), len(prompts), batched)

    specs = []
    for ids, base in zip(prompts, bases):
        for k, rid in enumerate(fan_out_rids(base, n)):
            specs.append(RequestSpec(
                rid=rid, input_ids=ids,
                sampling_params=SamplingParams(**{**_fields(sp), "seed": seed_for_sample(sp.seed, k)}),
                stop=stop, return_logprob=return_logprob, top_logprobs_num=top_n,
                group=base if n > 1 else None, cache_salt=cache_salt))
    return GenerateInput(specs=specs, stream=stream, batched=batched,
                         return_text_in_logprobs=text_in_logprobs)


def _fields(sp: SamplingParams) -> dict[str, Any]:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}
