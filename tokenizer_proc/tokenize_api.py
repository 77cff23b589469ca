"""`POST /tokenize` and `/detokenize` (also under /v1/), in one shape that
SGLang's and vLLM's clients both read.

- tokenize: `{"prompt": text or [texts], "add_special_tokens"}` (SGLang's and
  vLLM's) or `{"messages": [...], "add_generation_prompt",
  "continue_final_message", "chat_template_kwargs"}` (vLLM's: the chat
  template's ids) -> `{"tokens", "count", "max_model_len"}`, plus vLLM's
  `token_strs` with `return_token_strs`. A list of prompts (SGLang's) gives
  lists of tokens and counts.
- detokenize: `{"tokens": ids or [ids], "skip_special_tokens"}` ->
  `{"text", "prompt"}`: SGLang answers `text`, vLLM `prompt`; both are sent.
  skip_special_tokens defaults to true (SGLang's; vLLM keeps special tokens).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenizer_proc.app_keys import MODEL_INFO, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.chat_options import check_chat_options
from tokenizer_proc.errors import BadRequestError, json_response
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.openai_protocol import chat_messages
from tokenizer_proc.protocol import MAX_OUTPUTS
from tokenizer_proc.tokenizer import NoChatTemplateError, Tokenizer
from tokenizer_proc.validation import check_bool, is_int, optional, parse_json_object


async def tokenize(request: web.Request) -> web.Response:
    body = parse_json_object(await read_body(request))
    info, tokenizer = request.app[MODEL_INFO], request.app[TOKENIZER]
    return_strs = optional(body, "return_token_strs", check_bool, False)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise BadRequestError("give exactly one of prompt (a string or a list of strings) or messages")
    if body.get("messages") is not None:
        ids: Any = await request.app[TOKENIZER_POOL].run(_chat_ids, body, tokenizer)
        count: Any = len(ids)
    else:
        prompts, batched = _prompts(body["prompt"])
        special = optional(body, "add_special_tokens", check_bool, True)
        encoded = await request.app[TOKENIZER_POOL].run(_encode_all, tokenizer, prompts, special)
        ids, count = (encoded, [len(e) for e in encoded]) if batched else (encoded[0], len(encoded[0]))
    answer: dict[str, Any] = {"tokens": ids, "count": count, "max_model_len": info.context_len}
    if return_strs:
        strs = [_token_strs(tokenizer, row) for row in ids] if isinstance(count, list) else _token_strs(tokenizer, ids)
        answer["token_strs"] = strs
    return json_response(answer)


def _prompts(prompt: Any) -> tuple[list[str], bool]:
    if isinstance(prompt, str):
        return [prompt], False
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_OUTPUTS:
            raise BadRequestError(f"at most {MAX_OUTPUTS} prompts per request")
        return prompt, True
    raise BadRequestError("prompt must be a string or a non-empty list of strings")


def _encode_all(tokenizer: Tokenizer, prompts: list[str], special: bool) -> list[list[int]]:
    return [tokenizer.encode(p) if special else tokenizer.encode(p, add_special_tokens=False) for p in prompts]


def _chat_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """vLLM's chat form: the ids the chat routes would send (add_generation_prompt
    true by default; false renders the conversation alone)."""
    messages = chat_messages(body["messages"])
    options = check_chat_options(body, [m["role"] for m in messages])
    add_prompt = optional(body, "add_generation_prompt", check_bool, True)
    if not add_prompt and not options.continue_final:
        raise BadRequestError("add_generation_prompt false is only supported with continue_final_message "
                              "(the conversation rendered up to the last message's content)")
    try:
        if options.template_defaults:
            return tokenizer.apply_chat_template(messages)
        return tokenizer.apply_chat_template(messages, continue_final=options.continue_final,
                                             template_kwargs=options.template_kwargs)
    except NoChatTemplateError as e:
        raise BadRequestError(str(e)) from None
    except Exception as e:  # the template's own checks (role order, ...)
        raise BadRequestError(f"cannot apply the chat template: {e}") from None


def _token_strs(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


async def detokenize(request: web.Request) -> web.Response:
    body = parse_json_object(await read_body(request))
    vocab = request.app[MODEL_INFO].vocab_size
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequestError("tokens must be a list of token ids, or a list of such lists")
    batched = bool(tokens) and isinstance(tokens[0], list)
    rows = tokens if batched else [tokens]
    for k, row in enumerate(rows):
        if not isinstance(row, list) or not all(is_int(t) for t in row):
            raise BadRequestError(f"tokens{f'[{k}]' if batched else ''} must be a list of integer token ids")
        bad = next((t for t in row if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequestError(f"token id {bad} is out of range [0, {vocab})")
    skip = optional(body, "skip_special_tokens", check_bool, True)
    tokenizer = request.app[TOKENIZER]
    texts = await request.app[TOKENIZER_POOL].run(
        lambda: [tokenizer.decode(row, skip_special_tokens=skip) for row in rows])
    text: Any = texts if batched else texts[0]
    return json_response({"text": text, "prompt": text})
