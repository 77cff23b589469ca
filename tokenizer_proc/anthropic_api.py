"""Anthropic's Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, so the `anthropic` client (and tools built
on it) work against this server.

The body is translated into a chat completions body and run through that
path (tokenizer_proc/chat_bridge.py): `system` (a string or text blocks)
becomes a system message, content blocks are joined text, a last assistant
message is continued (Anthropic's prefill: continue_final_message),
`stop_sequences` are stop strings. With --reasoning-parser the thinking
comes back as a `thinking` block before the `text` block, and `thinking`'s
`budget_tokens` is the thinking budget (without a parser `thinking` is
ignored). Errors on these
routes take Anthropic's shape ({"type": "error", "error": {"type", "message"}},
tokenizer_proc/errors.py). Not implemented: tools (tool_use and tool_result
blocks are a 400), images and documents, thinking signatures (empty).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tokenizer_proc.app_keys import MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.chat_bridge import ChatRun, finish_of, start_chat, stopped_on_string
from tokenizer_proc.errors import BadRequestError, anthropic_error_body, json_response
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.named_sse import NamedEvent, stream_named_events
from tokenizer_proc.openai_api import served_model_name
from tokenizer_proc.openai_protocol import check_chat_request
from tokenizer_proc.reasoning import Split
from tokenizer_proc.validation import (check_bool, check_int, check_number, check_range, check_stop, optional,
                                       parse_json_object)

# input blocks that carry no text for the template: a past answer's thinking
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
_TOOL_BLOCKS = ("tool_use", "tool_result", "server_tool_use", "web_search_tool_result")


def _block_text(content: Any, where: str) -> str:
    """A message's (or system's) content: a string, or blocks whose text is joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{where} must be a string or a list of content blocks")
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in _SKIPPED_BLOCKS:
            continue
        elif kind in _TOOL_BLOCKS:
            raise BadRequestError(f"{where}[{k}]: {kind} blocks are not supported (no tool use on this server)")
        else:
            raise BadRequestError(f"{where}[{k}]: only text blocks are supported (this server serves text models), "
                                  f"not {str(kind)[:40]!r}")
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: at least one message is required")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _block_text(body["system"], "system")})
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequestError(f"messages[{k}].role must be \"user\" or \"assistant\"")
        out.append({"role": m["role"], "content": _block_text(m.get("content"), f"messages[{k}].content")})
    return out


def _chat_body(body: dict[str, Any], count_only: bool = False, reasoning: bool = False) -> dict[str, Any]:
    """The chat completions body that does what this Messages body asks;
    `reasoning`: the server has a --reasoning-parser (else `thinking` is
    ignored: the model does not think)."""
    if body.get("tools") or body.get("tool_choice") not in (None, {"type": "auto"}, {"type": "none"}):
        raise BadRequestError("tools are not supported on this server")
    messages = _messages(body)
    chat: dict[str, Any] = {"messages": messages,
                            "continue_final_message": messages[-1]["role"] == "assistant"}
    if count_only:
        return chat
    if body.get("max_tokens") is None:
        raise BadRequestError("max_tokens: field required")
    if check_int("max_tokens", body["max_tokens"]) < 1:
        raise BadRequestError("max_tokens must be >= 1")
    temperature = optional(body, "temperature", check_number, 1.0)
    check_range("temperature", temperature, 0.0, 1.0)  # Anthropic's range
    chat.update(max_tokens=body["max_tokens"], temperature=temperature,
                stream=optional(body, "stream", check_bool, False),
                stop=optional(body, "stop_sequences", check_stop, None))
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    thinking = body.get("thinking")
    if reasoning and isinstance(thinking, dict) and thinking.get("type") == "enabled" \
            and thinking.get("budget_tokens") is not None:
        chat["thinking_budget"] = thinking["budget_tokens"]
    return chat


async def count_tokens(request: web.Request) -> web.Response:
    body = await _read(request)
    pending = check_chat_request(_chat_body(body, count_only=True), request.app[MODEL_INFO],
                                 request.app[PROMPT_CHAR_LIMIT])
    encoded = await request.app[TOKENIZER_POOL].run(pending.encode, request.app[TOKENIZER])
    return json_response({"input_tokens": len(encoded[0][0])})


async def _read(request: web.Request) -> dict[str, Any]:
    return parse_json_object(await read_body(request))


async def messages(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    chat = _chat_body(await _read(request), reasoning=bool(request.app[SERVER_ARGS].reasoning_parser))
    run = await start_chat(request, chat, arrival)
    shaper = MessageShaper(run, served_model_name(request.app))
    try:
        if run.inp.stream:
            await run.gen.admitted()
            return await stream_named_events(request, shaper.events(), shaper.id, _error_event)
        await run.gen.wait()
        return json_response(shaper.message())
    finally:
        run.gen.abort()  # a no-op unless the client went away or something failed


def _error_event(message: str, status: int) -> NamedEvent:
    return "error", anthropic_error_body(message, status)


class MessageShaper:
    def __init__(self, run: ChatRun, model: str) -> None:
        self.run, self.model = run, model
        self.id = f"msg_{uuid.uuid4().hex}"

    def _stop(self) -> dict[str, Any]:
        reason = finish_of(self.run.out)  # raises for an abort
        matched = stopped_on_string(reason)
        stop_reason = {"stop": "stop_sequence" if matched is not None else "end_turn",
                       "length": "max_tokens"}[reason.type]
        return {"stop_reason": stop_reason, "stop_sequence": matched}

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.run.inp.prompt_tokens, "output_tokens": len(self.run.out.ids)}

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def message(self) -> dict[str, Any]:
        stop = self._stop()
        split = self.run.whole()
        content: list[dict[str, Any]] = []
        if split.reasoning:
            content.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
        content.append({"type": "text", "text": split.content})
        return {**self._envelope(), "content": content, **stop, "usage": self._usage()}

    async def events(self) -> AsyncIterator[NamedEvent]:
        yield "message_start", {"type": "message_start", "message": {
            **self._envelope(), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.run.inp.prompt_tokens, "output_tokens": 0}}}
        blocks = _Blocks()
        async for split in self.run.deltas():
            for event in blocks.add(split):
                yield event
        for event in blocks.close():
            yield event
        yield "message_delta", {"type": "message_delta", "delta": self._stop(),
                                "usage": {"output_tokens": len(self.run.out.ids)}}
        yield "message_stop", {"type": "message_stop"}


class _Blocks:
    """The content blocks of a stream: a thinking block (with
    --reasoning-parser) then one text block, each opened at its first text."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.text_opened = False

    def _switch(self, kind: str) -> list[NamedEvent]:
        events = self._close_open()
        self.index += 1
        self.open = kind
        self.text_opened |= kind == "text"
        block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                     "signature": ""}
        events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return events

    def _close_open(self) -> list[NamedEvent]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def add(self, split: Split) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        if split.reasoning:
            if self.open != "thinking":
                events += self._switch("thinking")
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "thinking_delta", "thinking": split.reasoning}}))
        if split.content:
            if self.open != "text":
                events += self._switch("text")
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": split.content}}))
        return events

    def close(self) -> list[NamedEvent]:
        """The end: a text block is always there, as in the whole answer."""
        events = [] if self.text_opened else self._switch("text")
        return events + self._close_open()
