"""OpenAI's Responses API, as vLLM and llama.cpp serve it: `POST /v1/responses`
(and `GET /v1/responses/{id}` for stored ones), so `client.responses.create`
works against this server.

Implemented: `input` (a string, or a list of message items whose content is a
string or input_text/output_text parts; reasoning items are skipped),
`instructions` (a system message, not carried over to a follow-up, as
OpenAI does), `max_output_tokens`, `temperature`, `top_p`, `text.format`
(text, json_object, json_schema: a grammar), `metadata` (echoed), `stream`
with the named events, `store` (default false: stateless) and
`previous_response_id` (the stored conversation comes first; a bounded LRU
in this process, tokenizer_proc/response_store.py). With --reasoning-parser
the thinking is a `reasoning` output item before the message. Not
implemented: tools (function calls), background, images and files,
truncation other than "disabled", conversations.

The body is translated into a chat completions body and run through that
path (tokenizer_proc/chat_bridge.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tokenizer_proc.chat_bridge import ChatRun, finish_of, start_chat
from tokenizer_proc.errors import BadRequestError, error_body, json_response
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.named_sse import NamedEvent, stream_named_events
from tokenizer_proc.openai_api import served_model_name
from tokenizer_proc.reasoning import Split
from tokenizer_proc.response_store import ResponseStore, StoredResponse
from tokenizer_proc.validation import check_bool, check_int, optional, parse_json_object

STORE = web.AppKey("response_store", ResponseStore)

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{where} must be a string or a list of content parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise BadRequestError(f"{where}[{k}]: only input_text parts are supported (this server serves text "
                                  f"models), not {str(kind)[:40]!r}")
    return "".join(texts)


def input_messages(value: Any) -> list[dict[str, str]]:
    """`input` as chat messages."""
    if isinstance(value, str):
        if not value:
            raise BadRequestError("input must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequestError("input must be a string or a non-empty list of items")
    out = []
    for k, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequestError(f"input[{k}] must be an object")
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # a past answer's thinking: not part of the prompt
        if kind != "message":
            raise BadRequestError(f"input[{k}]: items of type {str(kind)[:40]!r} are not supported "
                                  "(message items only: no tools on this server)")
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise BadRequestError(f"input[{k}].role must be user, system, developer or assistant")
        out.append({"role": role, "content": _content_text(item.get("content"), f"input[{k}].content")})
    return out


def _response_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequestError("text.format.type must be text, json_object or json_schema")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt["type"]}


def _check_unsupported(body: dict[str, Any]) -> None:
    if body.get("tools"):
        raise BadRequestError("tools are not supported on this server")
    if body.get("background"):
        raise BadRequestError("background responses are not supported")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequestError("truncation must be \"disabled\" (prompts are never truncated here)")
    if body.get("conversation") is not None:
        raise BadRequestError("conversations are not supported: use previous_response_id")


def _chat_body(body: dict[str, Any], history: list[dict[str, str]]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The chat completions body for this request, and the conversation to
    store (without the instructions)."""
    _check_unsupported(body)
    if body.get("input") is None:
        raise BadRequestError("input is required")
    conversation = history + input_messages(body["input"])
    messages = list(conversation)
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise BadRequestError("instructions must be a string")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict[str, Any] = {"messages": messages, "stream": optional(body, "stream", check_bool, False)}
    if body.get("max_output_tokens") is not None:
        if check_int("max_output_tokens", body["max_output_tokens"]) < 1:
            raise BadRequestError("max_output_tokens must be >= 1")
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "stop", "cache_salt", "priority", "chat_template_kwargs", "thinking_budget",
                 "separate_reasoning"):
        if body.get(name) is not None:
            chat[name] = body[name]
    fmt = _response_format(body.get("text"))
    if fmt is not None and fmt["type"] != "text":
        chat["response_format"] = fmt
    return chat, conversation


async def create(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    body = parse_json_object(await read_body(request))
    store = optional(body, "store", check_bool, False)
    history: list[dict[str, str]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequestError("previous_response_id must be a string")
        found = request.app[STORE].get(previous)
        if found is None:
            raise BadRequestError(f"previous response {previous[:80]!r} not found: responses are kept only when "
                                  "created with store true, in this server process, up to a bound")
        history = found.conversation
    chat, conversation = _chat_body(body, history)
    run = await start_chat(request, chat, arrival)
    shaper = ResponseShaper(run, served_model_name(request.app), body)
    try:
        if run.inp.stream:
            await run.gen.admitted()
            events = shaper.events()
            if store:
                events = _storing(events, shaper, request.app[STORE], conversation)
            return await stream_named_events(request, events, shaper.id, shaper.error_event)
        await run.gen.wait()
        response = shaper.response()
        if store:
            _store(request.app[STORE], shaper, response, conversation)
        return json_response(response)
    finally:
        run.gen.abort()  # a no-op unless the client went away or something failed


async def retrieve(request: web.Request) -> web.Response:
    found = request.app[STORE].get(request.match_info["response_id"])
    if found is None:
        raise web.HTTPNotFound(reason=f"response {request.match_info['response_id'][:80]!r} not found")
    return json_response(found.response)


def _store(store: ResponseStore, shaper: ResponseShaper, response: dict[str, Any],
           conversation: list[dict[str, str]]) -> None:
    answer = shaper.run.whole().content
    store.put(shaper.id, StoredResponse(response, conversation + [{"role": "assistant", "content": answer}]))


async def _storing(events: AsyncIterator[NamedEvent], shaper: ResponseShaper, store: ResponseStore,
                   conversation: list[dict[str, str]]) -> AsyncIterator[NamedEvent]:
    async for name, event in events:
        if name == "response.completed" or name == "response.incomplete":
            _store(store, shaper, event["response"], conversation)
        yield name, event


class ResponseShaper:
    def __init__(self, run: ChatRun, model: str, body: dict[str, Any]) -> None:
        self.run, self.model, self.body = run, model, body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0

    def _status(self) -> tuple[str, dict[str, Any] | None]:
        reason = finish_of(self.run.out)  # raises for an abort
        if reason.type == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _usage(self) -> dict[str, Any]:
        inp, out = self.run.inp.prompt_tokens, len(self.run.out.ids)
        return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": self.run.out.state.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": inp + out}

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None, "incomplete_details": incomplete,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
                "previous_response_id": b.get("previous_response_id"), "metadata": b.get("metadata") or {},
                "store": bool(b.get("store", False)), "parallel_tool_calls": False, "tool_choice": "none",
                "tools": [], "text": {"format": {"type": "text"}} if not b.get("text") else b["text"],
                "truncation": "disabled", "background": False, "usage": usage}

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _output(self, split: Split, status: str) -> list[dict[str, Any]]:
        items = [self._reasoning_item(split.reasoning, status)] if split.reasoning else []
        return items + [self._message_item(split.content, status)]

    def response(self) -> dict[str, Any]:
        status, incomplete = self._status()
        return self._object(status, self._output(self.run.whole(), "completed"), self._usage(), incomplete)

    # ---- streaming -------------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> NamedEvent:
        self.seq += 1
        return name, {"type": name, "sequence_number": self.seq - 1, **fields}

    def error_event(self, message: str, status: int) -> NamedEvent:
        err = error_body(message, status, "invalid_request_error" if status == 400 else "server_error")["error"]
        return self._event("error", code=str(status), message=err["message"], param=None)

    async def events(self) -> AsyncIterator[NamedEvent]:
        yield self._event("response.created", response=self._object("in_progress", []))
        yield self._event("response.in_progress", response=self._object("in_progress", []))
        total = Split()
        open_item: str | None = None  # "reasoning" or "message", the item being streamed
        index = -1
        async for split in self.run.deltas():
            if split.reasoning:
                if open_item != "reasoning":
                    index += 1
                    open_item = "reasoning"
                    for ev in self._open_reasoning(index):
                        yield ev
                total.reasoning += split.reasoning
                yield self._event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=index,
                                  content_index=0, delta=split.reasoning)
            if split.content:
                if open_item != "message":
                    if open_item == "reasoning":
                        for ev in self._close_reasoning(index, total.reasoning):
                            yield ev
                    index += 1
                    open_item = "message"
                    for ev in self._open_message(index):
                        yield ev
                total.content += split.content
                yield self._event("response.output_text.delta", item_id=self.message_id, output_index=index,
                                  content_index=0, delta=split.content, logprobs=[])
        status, incomplete = self._status()
        if open_item == "reasoning":
            for ev in self._close_reasoning(index, total.reasoning):
                yield ev
        if open_item != "message":  # an answer without text still has its message
            index += 1
            for ev in self._open_message(index):
                yield ev
        for ev in self._close_message(index, total.content):
            yield ev
        final = self._object(status, self._output(total, "completed"), self._usage(), incomplete)
        yield self._event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def _open_reasoning(self, index: int) -> list[NamedEvent]:
        return [self._event("response.output_item.added", output_index=index,
                            item=self._reasoning_item("", "in_progress"))]

    def _close_reasoning(self, index: int, text: str) -> list[NamedEvent]:
        return [self._event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                            content_index=0, text=text),
                self._event("response.output_item.done", output_index=index,
                            item=self._reasoning_item(text, "completed"))]

    def _open_message(self, index: int) -> list[NamedEvent]:
        return [self._event("response.output_item.added", output_index=index,
                            item=self._message_item("", "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=index,
                            content_index=0, part=self._text_part(""))]

    def _close_message(self, index: int, text: str) -> list[NamedEvent]:
        return [self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                            content_index=0, part=self._text_part(text)),
                self._event("response.output_item.done", output_index=index,
                            item=self._message_item(text, "completed"))]
