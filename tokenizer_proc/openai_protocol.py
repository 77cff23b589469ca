"""Parsing OpenAI `/v1/completions` and `/v1/chat/completions` bodies.

Lenient where OpenAI clients are noisy (unknown fields such as `user` or
`metadata` are ignored, as SGLang and vLLM do), strict where a setting would
change the answer: a feature we do not implement (structural tags,
the deprecated `functions`, ...) is refused with a 400 that names the field and why, rather than
silently ignored. The field list is `sglang_fields.OPENAI_FIELDS`; SGLang's
(and vLLM's) extras are taken too (`top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `stop_regex`,
`no_stop_trim`, `skip_special_tokens`), which the `openai` client sends
through `extra_body`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from common.messages import Grammar, ModelInfo, SamplingParams, TokenizedGenerateReq
from tokenizer_proc.chat_options import ChatOptions, check_chat_options
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.grammar import grammar_from_fields, grammar_from_response_format
from tokenizer_proc.protocol import (MAX_N, MAX_OUTPUTS, check_fits_context, check_prompt_id_count, check_prompt_ids,
                                     check_prompt_text, validate_sampling_params)
from tokenizer_proc.request_spec import RequestSpec, fan_out_rids, seed_for_sample
from tokenizer_proc.sglang_fields import OPENAI_FIELDS, check_fields
from tokenizer_proc.tokenizer import NoChatTemplateError, Tokenizer
from tokenizer_proc.tools import ToolRequest, assistant_tool_calls, tool_request, tool_result
from tokenizer_proc.validation import (cache_namespace, check_bool, check_cache_salt, check_int, check_int_list,
                                       check_logit_bias, check_number, check_priority, check_prompt_chars, check_range,
                                       check_stop, check_stop_regex, check_timeout, is_int, optional)

MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


@dataclass
class OpenAIInput:
    request_id: str  # the response's `id`; /abort_request accepts it
    specs: list[RequestSpec]  # prompt-major: choice index k is specs[k]
    prompt_tokens: int  # usage: every prompt counted once, whatever n is
    stream: bool
    include_usage: bool  # stream_options.include_usage
    logprobs: bool
    top_logprobs: int
    # completions' echo: choice k starts with echo_texts[k], its prompt (with
    # logprobs: the prompt's tokens and their logprobs too, the first null)
    echo: bool = False
    echo_texts: list[str] = field(default_factory=list)
    # echo with max_tokens 0: one token is generated (the server's minimum) and
    # none of it shown or counted: the answer is the prompt alone
    hide_output: bool = False
    tools: ToolRequest | None = None  # chat with tools that may be called: the output is parsed for calls
    chat: ChatOptions | None = None  # chat: template and reasoning options


def _refuse_unless_default(body: dict[str, Any]) -> None:
    """A field we cannot honour set to anything but its no-op value is a 400
    naming it and why (unknown fields are ignored)."""
    if body.get("best_of") is not None and body.get("best_of") == body.get("n", 1):
        body = {k: v for k, v in body.items() if k != "best_of"}  # best_of == n: n samples, all returned
    check_fields(body, OPENAI_FIELDS, strict=False)


def _sampling(body: dict[str, Any], max_tokens: int, vocab_size: int) -> SamplingParams:
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
        frequency_penalty=optional(body, "frequency_penalty", check_number, 0.0),
        presence_penalty=optional(body, "presence_penalty", check_number, 0.0),
        repetition_penalty=optional(body, "repetition_penalty", check_number, 1.0),
        min_new_tokens=optional(body, "min_tokens", check_int, 0),
        logit_bias=optional(body, "logit_bias", lambda k, v: check_logit_bias(k, v, MAX_LOGIT_BIAS), {}),
        grammar=_grammar(body),
    )
    validate_sampling_params(sp, vocab_size=vocab_size,
                             names={"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"})
    return sp


def _grammar(body: dict[str, Any]) -> Grammar | None:
    """response_format, or SGLang's json_schema / regex / ebnf: one at most."""
    from_format = grammar_from_response_format(body.get("response_format"))
    from_fields = grammar_from_fields(body)
    if from_format is not None and from_fields is not None:
        raise BadRequestError("response_format and json_schema/regex/ebnf are mutually exclusive: "
                              "one grammar per request")
    return from_format or from_fields


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    """max_completion_tokens (chat's newer name) wins over max_tokens."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is not None:
            if check_int(name, v) < 1:
                raise BadRequestError(f"{name} must be >= 1")
            return v
    return default


@dataclass
class PendingOpenAI:
    """An OpenAI body that passed every check that needs no tokens; `encode`
    (on the tokenizer pool: a chat template, or the prompts' tokens) and
    `finish` (sampling and the context, per prompt) complete it."""

    body: dict[str, Any]
    info: ModelInfo
    prefix: str  # the response id's: cmpl, chatcmpl
    default_max_tokens: int | None  # None: whatever room the context leaves
    logprobs: bool
    top_logprobs: int
    logprob_start_len: int
    stream: bool
    include_usage: bool
    n: int
    stop: list[str]
    stop_regex: list[str]
    no_stop_trim: bool
    cache_salt: str
    timeout: float | None
    priority: int
    prompts: list[Any] = field(default_factory=list)  # completions: str or ids, as sent
    messages: list[dict[str, Any]] | None = None  # chat, unless input_ids is given
    tools: ToolRequest | None = None
    echo: bool = False
    hide_output: bool = False
    chat: ChatOptions | None = None

    def encode(self, tokenizer: Tokenizer) -> list[tuple[list[int], str]]:
        """Each prompt's ids and text (echo's: as sent, or the ids decoded)."""
        vocab = self.info.vocab_size
        if self.messages is not None:
            shown = self.tools is not None and self.tools.active  # "none": the tools are not shown
            try:
                chat = self.chat or ChatOptions()
                tools = self.tools.raw if shown else None
                if chat.template_defaults:
                    ids = tokenizer.apply_chat_template(self.messages, tools) if tools \
                        else tokenizer.apply_chat_template(self.messages)
                else:
                    ids = tokenizer.apply_chat_template(self.messages, tools, continue_final=chat.continue_final,
                                                        template_kwargs=chat.template_kwargs)
            except NoChatTemplateError as e:
                raise BadRequestError(str(e)) from None
            except Exception as e:  # the template's own checks (role order, ...) are client errors
                raise BadRequestError(f"cannot apply the chat template: {e}") from None
            return [(check_prompt_ids(ids, vocab), "")]
        out = []
        for p in self.prompts:
            if isinstance(p, str):
                out.append((check_prompt_ids(tokenizer.encode(p), vocab), p))
            else:
                ids = check_prompt_ids(p, vocab)
                out.append((ids, tokenizer.decode(ids, skip_special_tokens=False) if self.echo else ""))
        return out

    def finish(self, encoded: list[tuple[list[int], str]]) -> OpenAIInput:
        prompts = [ids for ids, _ in encoded]
        info, body, n = self.info, self.body, self.n
        request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        rids = iter(fan_out_rids(request_id, len(prompts) * n))
        specs = []
        for ids in prompts:
            # No max_tokens in chat: whatever room the context (and the KV pool) leaves.
            limit = min(info.context_len, info.max_total_tokens) - len(ids)
            max_tokens = _max_tokens(body, self.default_max_tokens if self.default_max_tokens else max(limit, 1))
            check_fits_context(len(ids), max_tokens, info.context_len, "max_tokens")
            sp = _sampling(body, max_tokens, info.vocab_size)
            if self.tools is not None and self.tools.active:
                sp.grammar = self.tools.grammar()
                if self.tools.parser.needs_special_tokens:  # its trigger is a special token
                    sp.skip_special_tokens = False
            for k in range(n):
                sample = SamplingParams(**{f: getattr(sp, f) for f in sp.__struct_fields__})
                sample.seed = seed_for_sample(sp.seed, k)
                req = TokenizedGenerateReq(
                    rid=next(rids), input_ids=ids, sampling_params=sample, return_logprob=self.logprobs,
                    top_logprobs_num=self.top_logprobs if self.logprobs else 0,
                    logprob_start_len=self.logprob_start_len if self.logprobs else -1,
                    cache_salt=self.cache_salt, timeout_s=self.timeout, priority=self.priority)
                specs.append(RequestSpec(req, stop=self.stop, stop_regex=self.stop_regex,
                                         no_stop_trim=self.no_stop_trim,
                                         group=request_id if len(prompts) * n > 1 else None))
        inp = OpenAIInput(request_id=request_id, specs=specs, prompt_tokens=sum(len(p) for p in prompts),
                          stream=self.stream, include_usage=self.include_usage, logprobs=self.logprobs,
                          top_logprobs=self.top_logprobs, chat=self.chat,
                          tools=self.tools if self.tools is not None and self.tools.active else None)
        if self.echo:
            inp.echo, inp.hide_output = True, self.hide_output
            inp.echo_texts = [text for _, text in encoded for _ in range(n)]
        return inp


def _check_common(body: dict[str, Any], n_prompts: int, info: ModelInfo, prefix: str,
                  default_max_tokens: int | None, logprobs: bool, top_logprobs: int,
                  logprob_start_len: int = -1) -> PendingOpenAI:
    """Common to both routes, before tokenizing: sampling, n, stop strings, ..."""
    _refuse_unless_default(body)
    stream = optional(body, "stream", check_bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequestError("stream_options must be an object")
    include_usage = stream and optional(opts or {}, "include_usage", check_bool, False)
    n = optional(body, "n", check_int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequestError(f"n must be in [1, {MAX_N}]")
    if n_prompts * n > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} choices per request (prompts x n)")
    stop = optional(body, "stop", check_stop, [])
    stop_regex = optional(body, "stop_regex", check_stop_regex, [])
    no_stop_trim = optional(body, "no_stop_trim", check_bool, False)
    cache_salt = cache_namespace(optional(body, "cache_salt", check_cache_salt, ""),
                                 optional(body, "extra_key", check_cache_salt, ""))
    timeout = optional(body, "timeout", check_timeout, None)
    priority = optional(body, "priority", check_priority, 0)
    # Any model name is accepted: this server serves one model, and answers with its name.
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequestError("model must be a string")
    # The sampling fields' own checks, now: with the largest max_tokens any
    # prompt could get (finish() checks again with the prompt's own).
    room = min(info.context_len, info.max_total_tokens)
    _sampling(body, _max_tokens(body, default_max_tokens or room), info.vocab_size)
    return PendingOpenAI(body=body, info=info, prefix=prefix, default_max_tokens=default_max_tokens,
                         logprobs=logprobs, top_logprobs=top_logprobs, logprob_start_len=logprob_start_len,
                         stream=stream, include_usage=include_usage, n=n, stop=stop, stop_regex=stop_regex,
                         no_stop_trim=no_stop_trim, cache_salt=cache_salt, timeout=timeout, priority=priority)


# ---- /v1/completions -------------------------------------------------------------------------


def _completion_prompts(prompt: Any, context_len: int, char_limit: int | None) -> list[Any]:
    """A string, a list of strings, a list of token ids, or a list of lists of
    ids; checked without tokenizing."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and is_int(prompt[0]):  # one prompt's ids (checked below)
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise BadRequestError("prompt must be a string, a list of strings, or token ids")
    if len(items) > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} prompts per request")
    for k, p in enumerate(items):
        if isinstance(p, str):
            check_prompt_text(p, "prompt" if len(items) == 1 else f"prompt[{k}]", char_limit)
        elif isinstance(p, list):
            check_prompt_id_count(p, context_len)
            check_int_list("prompt", p)
        else:
            raise BadRequestError("prompt must be a string, a list of strings, or token ids")
    return items


def check_completion_request(body: dict[str, Any], info: ModelInfo,
                             char_limit: int | None = None) -> PendingOpenAI:
    if "prompt" not in body:
        raise BadRequestError("prompt is required")
    prompts = _completion_prompts(body["prompt"], info.context_len, char_limit)
    top = optional(body, "logprobs", check_int, None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    echo = optional(body, "echo", check_bool, False)
    hide_output = False
    if echo:
        if body.get("max_tokens") == 0 and is_int(body["max_tokens"]):
            # the prompt alone (lm-eval's log-likelihood): the server generates
            # at least one token; it is neither shown nor counted
            body, hide_output = {**body, "max_tokens": 1}, True
    pending = _check_common(body, len(prompts), info, "cmpl", COMPLETIONS_DEFAULT_MAX_TOKENS,
                            logprobs=top is not None, top_logprobs=top or 0, logprob_start_len=0 if echo else -1)
    pending.prompts, pending.echo, pending.hide_output = prompts, echo, hide_output
    return pending


def parse_completion_request(body: dict[str, Any], tokenizer: Tokenizer, info: ModelInfo,
                             char_limit: int | None = None) -> OpenAIInput:
    """All steps in one call, on the caller's thread (the HTTP handler runs
    `encode` on the tokenizer pool instead)."""
    pending = check_completion_request(body, info, char_limit)
    return pending.finish(pending.encode(tokenizer))


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
                raise BadRequestError(f"messages[{k}].content: only text parts are supported "
                                      "(this server serves text models)")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequestError(f"messages[{k}].content must be a string or a list of text parts")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages for the template: role and text content; an assistant's
    tool_calls and a tool result's call id (which must be an earlier call's)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # the history's tool call ids -> function names
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequestError(f"messages[{k}] must be an object with a string role")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequestError(f"messages[{k}].role {m['role']!r} is not supported")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name
        content = _message_text(m.get("content"), k)
        if role == "tool":
            out.append(tool_result(m, k, calls, content))
        elif role == "assistant" and m.get("tool_calls"):
            out.append({"role": role, "content": content,
                        "tool_calls": assistant_tool_calls(m["tool_calls"], k, calls)})
        else:
            out.append({"role": role, "content": content})
    return out


def check_chat_request(body: dict[str, Any], info: ModelInfo, char_limit: int | None = None,
                       tool_parser: str | None = "hermes") -> PendingOpenAI:
    """`tool_parser`: the server's tool-call format (None: it cannot read calls)."""
    messages = chat_messages(body.get("messages"))
    tools = tool_request(body, tool_parser)
    ids = None
    if body.get("input_ids") is not None:  # SGLang's: the prompt's ids, instead of the template
        ids = body["input_ids"]
        if isinstance(ids, list):
            check_prompt_id_count(ids, info.context_len)
        check_int_list("input_ids", ids)
    else:  # the template adds a little: the messages' text alone must fit
        check_prompt_chars("messages", "".join(m["content"] for m in messages), char_limit)
    logprobs = optional(body, "logprobs", check_bool, False)
    top = optional(body, "top_logprobs", check_int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if top and not logprobs:
        raise BadRequestError("top_logprobs needs logprobs to be true")
    if optional(body, "echo", check_bool, False):
        raise BadRequestError("echo is not supported on chat completions (only on /v1/completions)")
    pending = _check_common(body, 1, info, "chatcmpl", None, logprobs=logprobs, top_logprobs=top)
    pending.tools = tools
    pending.chat = check_chat_options(body, [m["role"] for m in messages])
    if ids is None:
        pending.messages = messages
    else:
        pending.prompts = [ids]
    return pending


def parse_chat_request(body: dict[str, Any], tokenizer: Tokenizer, info: ModelInfo,
                       char_limit: int | None = None) -> OpenAIInput:
    pending = check_chat_request(body, info, char_limit)
    return pending.finish(pending.encode(tokenizer))
