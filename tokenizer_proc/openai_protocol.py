"""Parsing OpenAI `/v1/completions` and `/v1/chat/completions` bodies.

Lenient where OpenAI clients are noisy (unknown fields such as `user` or
`metadata` are ignored, as SGLang and vLLM do), strict where a setting would
change the answer: a feature we do not implement (penalties, tools, echo, ...)
is refused with a 400 rather than silently ignored. A few SGLang extras are
accepted too (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`), which the `openai` client sends through `extra_body`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from common.messages import ModelInfo, SamplingParams
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.protocol import MAX_N, MAX_OUTPUTS, check_fits_context, check_prompt_ids, validate_sampling_params
from tokenizer_proc.request_spec import RequestSpec, fan_out_rids, seed_for_sample
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import (check_bool, check_cache_salt, check_int, check_int_list, check_number,
                                       check_range, check_stop, is_int, optional)

MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class OpenAIInput:
    request_id: str  # the response's `id`; /abort_request accepts it
    specs: list[RequestSpec]  # prompt-major: choice index k is specs[k]
    prompt_tokens: int  # usage: every prompt counted once, whatever n is
    stream: bool
    include_usage: bool  # stream_options.include_usage
    logprobs: bool
    top_logprobs: int


# Fields we cannot honour: allowed only at their no-op value.
def _refuse_unless_default(body: dict[str, Any]) -> None:
    def bad(field: str) -> BadRequestError:
        return BadRequestError(f"{field} is not supported by this server")

    for field in ("frequency_penalty", "presence_penalty"):
        v = body.get(field)
        if v is not None and check_number(field, v) != 0:
            raise bad(field)
    for field in ("logit_bias", "tools", "functions", "suffix"):
        if body.get(field):
            raise bad(field)
    if body.get("echo"):
        raise bad("echo")
    if body.get("tool_choice") not in (None, "none"):
        raise bad("tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format")
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, body.get("n", 1)):
        raise bad("best_of")


def _sampling(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    temperature = optional(body, "temperature", check_number, 1.0)
    check_range("temperature", temperature, 0.0, 2.0)
    sp = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=optional(body, "top_p", check_number, 1.0),
        top_k=optional(body, "top_k", check_int, -1),
        min_p=optional(body, "min_p", check_number, 0.0),
        stop_token_ids=optional(body, "stop_token_ids", check_int_list, []),
        ignore_eos=optional(body, "ignore_eos", check_bool, False),
        skip_special_tokens=optional(body, "skip_special_tokens", check_bool, True),
        seed=optional(body, "seed", check_int, None),
    )
    validate_sampling_params(sp)
    return sp


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    """max_completion_tokens (chat's newer name) wins over max_tokens."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is not None:
            if check_int(name, v) < 1:
                raise BadRequestError(f"{name} must be >= 1")
            return v
    return default


def _build(body: dict[str, Any], prompts: list[list[int]], info: ModelInfo, prefix: str,
           default_max_tokens: int | None, logprobs: bool, top_logprobs: int) -> OpenAIInput:
    """Common to both routes: sampling, fan-out into n x prompts requests, rids."""
    _refuse_unless_default(body)
    stream = optional(body, "stream", check_bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequestError("stream_options must be an object")
    include_usage = stream and optional(opts or {}, "include_usage", check_bool, False)
    n = optional(body, "n", check_int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequestError(f"n must be in [1, {MAX_N}]")
    if len(prompts) * n > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} choices per request (prompts x n)")
    stop = optional(body, "stop", check_stop, [])
    cache_salt = optional(body, "cache_salt", check_cache_salt, "")
    # Any model name is accepted: this server serves one model, and answers with its name.
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequestError("model must be a string")

    request_id = f"{prefix}-{uuid.uuid4().hex}"
    rids = iter(fan_out_rids(request_id, len(prompts) * n))
    specs = []
    for ids in prompts:
        # No max_tokens in chat: whatever room the context (and the KV pool) leaves.
        limit = min(info.context_len, info.max_total_tokens) - len(ids)
        max_tokens = _max_tokens(body, default_max_tokens if default_max_tokens else max(limit, 1))
        check_fits_context(len(ids), max_tokens, info.context_len, "max_tokens")
        sp = _sampling(body, max_tokens)
        for k in range(n):
            sample = SamplingParams(**{f: getattr(sp, f) for f in sp.__struct_fields__})
            sample.seed = seed_for_sample(sp.seed, k)
            specs.append(RequestSpec(rid=next(rids), input_ids=ids, sampling_params=sample, stop=stop,
                                     return_logprob=logprobs, top_logprobs_num=top_logprobs,
                                     group=request_id if len(prompts) * n > 1 else None,
                                     cache_salt=cache_salt))
    return OpenAIInput(request_id=request_id, specs=specs, prompt_tokens=sum(len(p) for p in prompts),
                       stream=stream, include_usage=include_usage, logprobs=logprobs,
                       top_logprobs=top_logprobs)


# ---- /v1/completions -------------------------------------------------------------------------


def _completion_prompts(prompt: Any, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of ids."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(x) for x in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise BadRequestError("prompt must be a string, a list of strings, or token ids")
    prompts = []
    for p in items:
        if isinstance(p, str):
            prompts.append(tokenizer.encode(p) if p else [])
        elif isinstance(p, list):
            prompts.append(check_int_list("prompt", p))
        else:
            raise BadRequestError("prompt must be a string, a list of strings, or token ids")
    return [check_prompt_ids(ids, vocab_size) for ids in prompts]


def parse_completion_request(body: dict[str, Any], tokenizer: Tokenizer, info: ModelInfo) -> OpenAIInput:
    if "prompt" not in body:
        raise BadRequestError("prompt is required")
    prompts = _completion_prompts(body["prompt"], tokenizer, info.vocab_size)
    top = optional(body, "logprobs", check_int, None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    return _build(body, prompts, info, "cmpl", COMPLETIONS_DEFAULT_MAX_TOKENS,
                  logprobs=top is not None, top_logprobs=top or 0)


# ---- /v1/chat/completions --------------------------------------------------------------------


def _message_text(content: Any, k: int) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(f"messages[{k}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequestError(f"messages[{k}].content must be a string or a list of text parts")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequestError(f"messages[{k}] must be an object with a string role")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise BadRequestError(f"messages[{k}].role {m['role']!r} is not supported")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name
        out.append({"role": role, "content": _message_text(m.get("content"), k)})
    return out


def parse_chat_request(body: dict[str, Any], tokenizer: Tokenizer, info: ModelInfo) -> OpenAIInput:
    messages = chat_messages(body.get("messages"))
    try:
        ids = tokenizer.apply_chat_template(messages)
    except Exception as e:  # the template's own checks (role order, ...) are client errors
        raise BadRequestError(f"cannot apply the chat template: {e}") from None
    check_prompt_ids(ids, info.vocab_size)
    logprobs = optional(body, "logprobs", check_bool, False)
    top = optional(body, "top_logprobs", check_int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if top and not logprobs:
        raise BadRequestError("top_logprobs needs logprobs to be true")
    return _build(body, [ids], info, "chatcmpl", None, logprobs=logprobs, top_logprobs=top)
