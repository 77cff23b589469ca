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
tokenizer_proc/errors.py). Client tools (`tools`, `tool_choice`, tool_use
and tool_result blocks, tool_use output blocks streamed as input_json_delta)
go through the chat path's tool calling. Not implemented: server tools,
images and documents, thinking signatures (empty).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tokenizer_proc.app_keys import MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.chat_bridge import ChatRun, Piece, finish_of, start_chat, stopped_on_string, tool_parser_of
from tokenizer_proc.errors import BadRequestError, anthropic_error_body, json_response
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.named_sse import NamedEvent, stream_named_events
from tokenizer_proc.openai_api import served_model_name
from tokenizer_proc.openai_protocol import check_chat_request
from tokenizer_proc.tool_calls.base import CallArgs, CallStart, Event, Text
from tokenizer_proc.validation import (check_bool, check_int, check_number, check_range, check_stop, optional,
                                       parse_json_object)

# input blocks that carry no text for the template: a past answer's thinking
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
_SERVER_TOOL_BLOCKS = ("server_tool_use", "web_search_tool_result")


def _block_text(content: Any, where: str) -> str:
    """A message's (or system's, or tool result's) content: a string, or
    blocks whose text is joined."""
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
        elif kind in _SERVER_TOOL_BLOCKS:
            raise BadRequestError(f"{where}[{k}]: {kind} blocks are not supported (no server tools here)")
        else:
            raise BadRequestError(f"{where}[{k}]: only text blocks are supported (this server serves text models), "
                                  f"not {str(kind)[:40]!r}")
    return "".join(texts)


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_use block as a chat tool call."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input", {}), dict):
        raise BadRequestError(f"{where}: a tool_use block needs a string id and name and an object input")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"],
                                                                "arguments": block.get("input", {})}}


def _tool_result(block: dict[str, Any], where: str, known: set[str]) -> dict[str, Any]:
    """A user's tool_result block as a tool message; it must answer an
    earlier tool_use. An error result's text says so."""
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise BadRequestError(f"{where}: a tool_result block needs a string tool_use_id")
    if use_id not in known:
        raise BadRequestError(f"{where}: tool_use_id {use_id[:80]!r} matches no earlier tool_use block")
    text = _block_text(block.get("content", ""), f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": use_id, "content": text}


def _turn(m: dict[str, Any], k: int, known: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text and calls,
    or a user's tool results (tool messages) then its text."""
    role, content, where = m["role"], m.get("content"), f"messages[{k}].content"
    if not isinstance(content, list):
        return [{"role": role, "content": _block_text(content, where)}]
    texts: list[dict[str, Any]] = []
    tool_blocks: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            tool_blocks.append(_tool_use(block, f"{where}[{j}]"))
            known.add(block["id"])
        elif kind == "tool_result" and role == "user":
            tool_blocks.append(_tool_result(block, f"{where}[{j}]", known))
        elif kind in ("tool_use", "tool_result"):
            raise BadRequestError(f"{where}[{j}]: {kind} blocks belong in "
                                  f"{'assistant' if kind == 'tool_use' else 'user'} messages")
        else:
            texts.append(block)
    text = _block_text(texts, where) if texts else ""
    if role == "assistant":
        return [{"role": role, "content": text, **({"tool_calls": tool_blocks} if tool_blocks else {})}]
    return tool_blocks + ([{"role": role, "content": text}] if texts or not tool_blocks else [])


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages: at least one message is required")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _block_text(body["system"], "system")})
    known: set[str] = set()  # the tool_use ids so far
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequestError(f"messages[{k}].role must be \"user\" or \"assistant\"")
        out += _turn(m, k, known)
    return out


def _chat_tool(k: int, tool: Any) -> dict[str, Any]:
    """An Anthropic (client) tool as a chat function tool."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequestError(f"tools[{k}]: only client tools (name, description, input_schema) are supported, "
                              f"not {str(kind)[:40]!r}")
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice as chat's: auto, any (required), tool (named),
    none; disable_parallel_tool_use is parallel_tool_calls false."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequestError("tools must be a list of tools")
        chat["tools"] = [_chat_tool(k, t) for k, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if choice is None:
        return chat
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise BadRequestError("tool_choice.type must be auto, any, tool (with a name) or none")
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not check_bool("tool_choice.disable_parallel_tool_use",
                                                     choice["disable_parallel_tool_use"])
    return chat


def _chat_body(body: dict[str, Any], count_only: bool = False, reasoning: bool = False) -> dict[str, Any]:
    """The chat completions body that does what this Messages body asks;
    `reasoning`: the server has a --reasoning-parser (else `thinking` is
    ignored: the model does not think)."""
    messages = _messages(body)
    last = messages[-1]
    chat: dict[str, Any] = {"messages": messages, **_tool_fields(body),
                            "continue_final_message": last["role"] == "assistant" and not last.get("tool_calls")}
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
                                 request.app[PROMPT_CHAR_LIMIT], tool_parser=tool_parser_of(request.app))
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

    def _stop(self, called: bool) -> dict[str, Any]:
        """stop_reason and stop_sequence; `called`: the answer has a complete call."""
        reason = finish_of(self.run.out)  # raises for an abort
        matched = stopped_on_string(reason)
        if reason.type == "stop" and called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        stop_reason = {"stop": "stop_sequence" if matched is not None else "end_turn",
                       "length": "max_tokens"}[reason.type]
        return {"stop_reason": stop_reason, "stop_sequence": matched}

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.run.inp.prompt_tokens, "output_tokens": len(self.run.out.ids)}

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def message(self) -> dict[str, Any]:
        answer = self.run.answer()
        blocks = _Blocks()
        blocks.add(Piece(answer.reasoning, answer.events))
        blocks.close()
        stop = self._stop(blocks.called)
        return {**self._envelope(), "content": blocks.content(), **stop, "usage": self._usage()}

    async def events(self) -> AsyncIterator[NamedEvent]:
        yield "message_start", {"type": "message_start", "message": {
            **self._envelope(), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.run.inp.prompt_tokens, "output_tokens": 0}}}
        blocks = _Blocks()
        async for piece in self.run.pieces():
            for event in blocks.add(piece):
                yield event
        for event in blocks.close():
            yield event
        yield "message_delta", {"type": "message_delta", "delta": self._stop(blocks.called),
                                "usage": {"output_tokens": len(self.run.out.ids)}}
        yield "message_stop", {"type": "message_stop"}


def _delta(index: int, delta: dict[str, Any]) -> NamedEvent:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


class _Blocks:
    """The content blocks of an answer, in order: a thinking block (with
    --reasoning-parser), text blocks (each opened at its first text) and
    tool_use blocks (one per call). Fed a stream's pieces it returns their
    events; fed the whole answer it builds the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # the blocks so far (a tool_use's input as its JSON text)
        self.open: str | None = None  # the open block's type
        self.complete: set[int] = set()  # the tool_use blocks whose call ended
        self.calls: dict[int, int] = {}  # a call's index -> its block's index

    @property
    def called(self) -> bool:
        return bool(self.complete)

    def _start(self, block: dict[str, Any]) -> list[NamedEvent]:
        events = self._stop_open()
        self.blocks.append(block)
        self.open = block["type"]
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": shown}))
        return events

    def _stop_open(self) -> list[NamedEvent]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def add(self, piece: Piece) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        if piece.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += piece.reasoning
            events.append(_delta(len(self.blocks) - 1, {"type": "thinking_delta", "thinking": piece.reasoning}))
        for e in piece.events:
            events += self._content_event(e)
        return events

    def _content_event(self, e: Event) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        if isinstance(e, Text):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += e.text
            return events + [_delta(len(self.blocks) - 1, {"type": "text_delta", "text": e.text})]
        if isinstance(e, CallStart):
            events = self._start({"type": "tool_use", "id": "toolu_" + e.id.removeprefix("call_"), "name": e.name,
                                  "input": ""})
            self.calls[e.index] = len(self.blocks) - 1
            return events
        index = self.calls[e.index]
        if isinstance(e, CallArgs):
            self.blocks[index]["input"] += e.text
            return [_delta(index, {"type": "input_json_delta", "partial_json": e.text})]
        self.complete.add(index)
        return self._stop_open()

    def close(self) -> list[NamedEvent]:
        """The end: an answer without text or calls still has its (empty) text block."""
        shown = any(b["type"] in ("text", "tool_use") for b in self.blocks)
        events = [] if shown else self._start({"type": "text", "text": ""})
        return events + self._stop_open()

    def content(self) -> list[dict[str, Any]]:
        """The whole answer's blocks: a tool_use's input as an object; a call
        cut by max_tokens is left out (it is no call)."""
        out = []
        for k, block in enumerate(self.blocks):
            if block["type"] != "tool_use":
                out.append(block)
            elif k in self.complete:
                out.append({**block, "input": json.loads(block["input"] or "{}")})
        return out
