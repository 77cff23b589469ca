"""Parsing and validating a native `/generate` request body.

Everything a client can get wrong is caught here and raised as
`BadRequestError`, which the HTTP layer turns into a 400; nothing invalid
ever reaches the scheduler. Checks run in two rounds around tokenizing:
`check_generate_request` does everything that needs no tokens (so a prompt
too long to ever fit is refused before anything tokenizes it), then the
handler encodes the prompts off the event loop, and `PendingGenerate.finish`
checks them against the context. One body becomes one `RequestSpec` per output:
a list of prompts and `n` samples fan out into len(prompts) * n requests,
prompt-major (all samples of prompt 0 first), which is the answer's order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from common.messages import SamplingParams, TokenizedGenerateReq
from common.sampling_rules import MAX_LOGIT_BIAS, sampling_error, token_ids_logprob_error
from common.sampling_rules import MAX_SEED as MAX_SEED_OF_A_SAMPLE
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.grammar import grammar_from_fields
from tokenizer_proc.request_spec import RequestSpec, fan_out_rids, seed_for_sample
from tokenizer_proc.sglang_fields import GENERATE_FIELDS, SAMPLING_FIELDS, check_fields
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import (cache_namespace, check_bool, check_cache_salt, check_int, check_int_list,
                                       check_logit_bias, check_number, check_priority, check_prompt_chars, check_rid,
                                       check_stop, check_stop_regex, check_timeout, is_int, optional,
                                       parse_json_object)

__all__ = ["BadRequestError", "GenerateInput", "PendingGenerate", "SamplingInput", "check_generate_request",
           "parse_generate_request", "parse_json_object", "parse_sampling_params", "check_prompt_ids",
           "check_fits_context", "check_prompt_id_count", "check_prompt_text", "encode_prompts"]

MAX_N = 128  # samples of one prompt
MAX_SEED = MAX_SEED_OF_A_SAMPLE - MAX_N  # sample k of n gets seed + k: a seed leaves room for that
MAX_OUTPUTS = 1024  # requests one body may fan out into
MAX_TOP_LOGPROBS = 100


@dataclass
class GenerateInput:
    specs: list[RequestSpec]
    stream: bool
    batched: bool  # the answer is a JSON list (a list of prompts, or n > 1)
    return_text_in_logprobs: bool


# sampling_params fields that go to the scheduler, and their type checks
_SAMPLING_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": check_int,
    "temperature": check_number,
    "top_p": check_number,
    "top_k": check_int,
    "min_p": check_number,
    "stop_token_ids": check_int_list,
    "ignore_eos": check_bool,
    "skip_special_tokens": check_bool,
    "seed": check_int,
    "frequency_penalty": check_number,
    "presence_penalty": check_number,
    "repetition_penalty": check_number,
    "min_new_tokens": check_int,
    "logit_bias": lambda k, v: check_logit_bias(k, v, MAX_LOGIT_BIAS),
    "stream_interval": check_int,
}


@dataclass
class SamplingInput:
    """One `sampling_params` object: what goes to the scheduler, and what is
    handled here (stop strings and regexes are matched on the text; n fans out)."""

    params: SamplingParams
    stop: list[str]
    stop_regex: list[str]
    no_stop_trim: bool
    n: int


def parse_sampling_params(obj: Any, vocab_size: int | None = None) -> SamplingInput:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise BadRequestError("sampling_params must be a JSON object")
    check_fields(obj, SAMPLING_FIELDS, "sampling_params.", defined_by="SGLang's SamplingParams")
    # null means "the default", as in SGLang's Python clients.
    kwargs = {k: check(f"sampling_params.{k}", obj[k]) for k, check in _SAMPLING_CHECKS.items()
              if obj.get(k) is not None}
    seed = optional(obj, "sampling_seed", lambda k, v: check_int(f"sampling_params.{k}", v), None)
    if seed is not None:  # SGLang's name; `seed` is this server's
        if kwargs.get("seed", seed) != seed:
            raise BadRequestError("sampling_params.seed and sampling_params.sampling_seed differ")
        kwargs["seed"] = seed
    kwargs["grammar"] = grammar_from_fields(obj, "sampling_params.")
    sp = SamplingParams(**kwargs)
    validate_sampling_params(sp, "sampling_params.", vocab_size)

    def local(key: str, check: Callable[[str, Any], Any], default: Any) -> Any:
        return optional(obj, key, lambda k, v: check(f"sampling_params.{k}", v), default)
    n = local("n", check_int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequestError(f"sampling_params.n must be in [1, {MAX_N}]")
    return SamplingInput(params=sp, stop=local("stop", check_stop, []),
                         stop_regex=local("stop_regex", check_stop_regex, []),
                         no_stop_trim=local("no_stop_trim", check_bool, False), n=n)


def validate_sampling_params(sp: SamplingParams, prefix: str = "", vocab_size: int | None = None,
                             names: dict[str, str] | None = None) -> None:
    """Range checks (common/sampling_rules.py); `prefix` and `names` name the
    fields as the client spelled them."""
    error = sampling_error(sp, vocab_size, prefix, names, max_seed=MAX_SEED)
    if error is not None:
        raise BadRequestError(error)
    if sp.top_k == 0:
        sp.top_k = -1  # 0 also means "off"


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


Prompt = str | list[int]  # a text to tokenize, or the client's token ids


def _prompt_sources(body: dict[str, Any], context_len: int,
                    char_limit: int | None) -> tuple[list[Prompt], bool]:
    """The prompts as sent, checked without tokenizing (types, count, length),
    and whether the body held a list of prompts."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequestError("exactly one of text or input_ids must be given")
    if text is not None:
        batched = isinstance(text, list)
        prompts: list[Any] = text if batched else [text]
        if not all(isinstance(t, str) for t in prompts):
            raise BadRequestError("text must be a string or a list of strings")
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
    if not prompts:
        raise BadRequestError("the list of prompts is empty")
    if len(prompts) > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} prompts per request")
    for k, p in enumerate(prompts):
        if text is not None:
            check_prompt_text(p, f"text[{k}]" if batched else "text", char_limit)
        else:  # the count first: a type scan of a million ids would hold up the loop
            if isinstance(p, list):
                check_prompt_id_count(p, context_len)
            check_int_list("input_ids", p)
    return prompts, batched


def check_prompt_text(p: str, label: str, char_limit: int | None) -> None:
    """Before tokenizing: not empty, and not so long it cannot fit the context."""
    if not p:
        raise BadRequestError("the prompt is empty")
    check_prompt_chars(label, p, char_limit)


def check_prompt_id_count(p: list[int], context_len: int) -> None:
    """Before the ids' range check: not empty, and leaving room for a token."""
    if not p:
        raise BadRequestError("the prompt is empty")
    if len(p) >= context_len:
        check_fits_context(len(p), 1, context_len)  # raises: no room for a new token


def encode_prompts(tokenizer: Tokenizer, prompts: list[Prompt], vocab_size: int) -> list[list[int]]:
    """The prompts' token ids. Runs on the tokenizer pool, off the event loop."""
    return [check_prompt_ids(tokenizer.encode(p) if isinstance(p, str) else p, vocab_size) for p in prompts]


def _client_rids(rid: Any, n_prompts: int, batched: bool) -> list[str]:
    """One base rid per prompt: the client's (a string, or a list with one per
    prompt) or a fresh one."""
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if n_prompts == 1 else [f"{base}-{p}" for p in range(n_prompts)]
    if isinstance(rid, str) and rid:
        check_rid("rid", rid)
        return [rid] if n_prompts == 1 else [f"{rid}-{p}" for p in range(n_prompts)]
    if isinstance(rid, list) and batched:
        if len(rid) != n_prompts or not all(isinstance(r, str) and r for r in rid):
            raise BadRequestError("rid must be a list of non-empty strings, one per prompt")
        for r in rid:
            check_rid("rid", r)
        return rid
    raise BadRequestError("rid must be a non-empty string" + (" or a list of them" if batched else ""))


@dataclass
class PendingGenerate:
    """A /generate body that passed every check that needs no tokens; `encode`
    (on the tokenizer pool) and `finish` (the checks against the context)
    complete it."""

    prompts: list[Prompt]
    sampling: list[SamplingInput]
    bases: list[str]
    batched: bool
    stream: bool
    return_logprob: bool
    top_n: int
    text_in_logprobs: bool
    start: int
    cache_salt: str
    timeout: float | None
    priority: int
    context_len: int
    vocab_size: int
    token_ids_logprob: list[list[int]] | None = None  # per prompt (None: none)

    def encode(self, tokenizer: Tokenizer) -> list[list[int]]:
        return encode_prompts(tokenizer, self.prompts, self.vocab_size)

    def finish(self, prompts: list[list[int]]) -> GenerateInput:
        start, n = self.start, self.sampling[0].n
        for ids, s in zip(prompts, self.sampling):
            check_fits_context(len(ids), s.params.max_new_tokens, self.context_len)
            if not -1 <= start < len(ids):
                raise BadRequestError(f"logprob_start_len ({start}) must be -1 or below the prompt length "
                                      f"({len(ids)} tokens)")
        specs = []
        token_ids = self.token_ids_logprob or [[]] * len(prompts)
        for ids, base, s, wanted in zip(prompts, self.bases, self.sampling, token_ids):
            sp = s.params
            for k, rid in enumerate(fan_out_rids(base, n)):
                req = TokenizedGenerateReq(
                    rid=rid, input_ids=ids,
                    sampling_params=SamplingParams(**{**_fields(sp), "seed": seed_for_sample(sp.seed, k)}),
                    return_logprob=self.return_logprob, top_logprobs_num=self.top_n if self.return_logprob else 0,
                    logprob_start_len=start if self.return_logprob else -1,
                    token_ids_logprob=wanted if self.return_logprob else [],
                    cache_salt=self.cache_salt, timeout_s=self.timeout, priority=self.priority)
                specs.append(RequestSpec(req, stop=s.stop, stop_regex=s.stop_regex, no_stop_trim=s.no_stop_trim,
                                         group=base if n > 1 else None))
        return GenerateInput(specs=specs, stream=self.stream, batched=self.batched,
                             return_text_in_logprobs=self.text_in_logprobs)


def check_generate_request(body: dict[str, Any], context_len: int, vocab_size: int,
                           char_limit: int | None = None) -> PendingGenerate:
    """Every check that needs no tokens, cheap enough for the event loop: field
    names and types, the number of prompts and of samples, rids, stop strings,
    and each prompt's length in characters (or ids)."""
    check_fields(body, GENERATE_FIELDS, defined_by="SGLang's GenerateReqInput")
    stream = optional(body, "stream", check_bool, False)
    return_logprob = optional(body, "return_logprob", check_bool, False)
    top_n = optional(body, "top_logprobs_num", check_int, 0)
    if not 0 <= top_n <= min(MAX_TOP_LOGPROBS, vocab_size):
        raise BadRequestError(f"top_logprobs_num must be in [0, {min(MAX_TOP_LOGPROBS, vocab_size)}]")
    text_in_logprobs = optional(body, "return_text_in_logprobs", check_bool, False)
    start = optional(body, "logprob_start_len", check_int, -1) if return_logprob else -1
    cache_salt = cache_namespace(optional(body, "cache_salt", check_cache_salt, ""),
                                 optional(body, "extra_key", check_cache_salt, ""))
    timeout = optional(body, "timeout", check_timeout, None)
    priority = optional(body, "priority", check_priority, 0)

    prompts, batched = _prompt_sources(body, context_len, char_limit)
    token_ids = parse_token_ids_logprob(body.get("token_ids_logprob"), len(prompts), batched, vocab_size)
    sampling = _sampling_per_prompt(body.get("sampling_params"), len(prompts), vocab_size)
    n = sampling[0].n
    if len(prompts) * n > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} outputs per request (prompts x n)")
    batched = batched or n > 1
    bases = _client_rids(body.get("rid"), len(prompts), batched)
    return PendingGenerate(prompts=prompts, sampling=sampling, bases=bases, batched=batched, stream=stream,
                           return_logprob=return_logprob, top_n=top_n, text_in_logprobs=text_in_logprobs,
                           start=start, cache_salt=cache_salt, timeout=timeout, priority=priority,
                           context_len=context_len, vocab_size=vocab_size,
                           token_ids_logprob=token_ids)


def parse_generate_request(
    body: dict[str, Any], tokenizer: Tokenizer, context_len: int, vocab_size: int,
    char_limit: int | None = None,
) -> GenerateInput:
    """All three steps in one call, on the caller's thread (the HTTP handler
    runs `encode` on the tokenizer pool instead)."""
    pending = check_generate_request(body, context_len, vocab_size, char_limit)
    return pending.finish(pending.encode(tokenizer))


def _sampling_per_prompt(obj: Any, n_prompts: int, vocab_size: int) -> list[SamplingInput]:
    """One sampling_params object for every prompt, or a list with one per
    prompt (SGLang's batch form); n must be the same in all."""
    if not isinstance(obj, list):
        return [parse_sampling_params(obj, vocab_size)] * n_prompts
    if len(obj) != n_prompts:
        raise BadRequestError(f"sampling_params: a list must have one object per prompt ({n_prompts})")
    out = [parse_sampling_params(o, vocab_size) for o in obj]
    if len({s.n for s in out}) > 1:
        raise BadRequestError("sampling_params: n must be the same for every prompt")
    return out


def _fields(sp: SamplingParams) -> dict[str, Any]:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}


def parse_token_ids_logprob(value: Any, n_prompts: int, prompt_list: bool,
                            vocab_size: int) -> list[list[int]] | None:
    """SGLang's token_ids_logprob: a list of token ids for every prompt, or,
    with a list of prompts, a list of such lists, one per prompt. Per prompt;
    None when no prompt asks. Each id must be in the vocabulary."""
    name = "token_ids_logprob"
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRequestError(f"{name} must be a list of token ids (integers)")
    nested = False
    if all(is_int(v) for v in value):
        per_prompt = [value] * n_prompts
    elif all(v is None or isinstance(v, list) for v in value):
        if not prompt_list:
            raise BadRequestError(f"{name} must be a flat list of token ids (integers): "
                                  "a list of lists is one per prompt, for a list of prompts")
        if len(value) != n_prompts:
            raise BadRequestError(f"{name}: a list of lists must have one list per prompt ({n_prompts})")
        per_prompt, nested = [v or [] for v in value], True
        for k, ids in enumerate(per_prompt):
            bad = next((j for j, t in enumerate(ids) if not is_int(t)), None)
            if bad is not None:
                raise BadRequestError(f"{name}[{k}][{bad}] must be an integer token id, not "
                                      f"{type(ids[bad]).__name__}")
    else:
        bad = next(j for j, t in enumerate(value) if not is_int(t))
        raise BadRequestError(f"{name}[{bad}] must be an integer token id, not {type(value[bad]).__name__}")
    for k, ids in enumerate(per_prompt):
        error = token_ids_logprob_error(ids, vocab_size, f"{name}[{k}]" if nested else name)
        if error is not None:
            raise BadRequestError(error)
    return per_prompt if any(per_prompt) else None
