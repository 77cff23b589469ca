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
the thinking is a `reasoning` output item before the message. Function
tools (`tools` in the flat shape, `tool_choice`, `parallel_tool_calls`,
`function_call` / `function_call_output` input items, `function_call`
output items and their stream events) go through the chat path's tool
calling. Not implemented: other tool types, background, images and files,
truncation other than "disabled", conversations.

The body is translated into a chat completions body and run through that
path (tokenizer_proc/chat_bridge.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from tokenizer_proc.chat_bridge import ChatRun, Piece, finish_of, start_chat
from tokenizer_proc.errors import BadRequestError, error_body, json_response
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.named_sse import NamedEvent, stream_named_events
from tokenizer_proc.openai_api import served_model_name
from tokenizer_proc.tool_calls.base import CallArgs, CallEnd, CallStart, Event, Text
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


def _function_call(item: dict[str, Any], k: int) -> dict[str, Any]:
    """A function_call input item as a chat tool call."""
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
        raise BadRequestError(f"input[{k}]: a function_call item needs string call_id, name and arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _add_call(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call joins the assistant turn right before it (its text, or other
    calls of the same answer), else opens one."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict[str, Any], k: int, known: set[str]) -> dict[str, Any]:
    """A function_call_output item as a tool message; its call must be an earlier one."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise BadRequestError(f"input[{k}]: a function_call_output item needs a string call_id")
    if call_id not in known:
        raise BadRequestError(f"input[{k}]: function_call_output's call_id {call_id[:80]!r} matches no "
                              "function_call before it")
    return {"role": "tool", "tool_call_id": call_id, "content": _content_text(item.get("output", ""),
                                                                              f"input[{k}].output")}


def call_ids(messages: list[dict[str, Any]]) -> set[str]:
    """The ids of the calls in chat messages (a stored conversation's)."""
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def input_messages(value: Any, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`input` as chat messages (`history`: the stored conversation before it,
    whose calls a function_call_output may answer)."""
    if isinstance(value, str):
        if not value:
            raise BadRequestError("input must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequestError("input must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    known = call_ids(history or [])
    for k, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequestError(f"input[{k}] must be an object")
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # a past answer's thinking: not part of the prompt
        if kind == "function_call":
            call = _function_call(item, k)
            known.add(call["id"])
            _add_call(out, call)
            continue
        if kind == "function_call_output":
            out.append(_call_output(item, k, known))
            continue
        if kind != "message":
            raise BadRequestError(f"input[{k}]: items of type {str(kind)[:40]!r} are not supported "
                                  "(message, function_call and function_call_output items only)")
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise BadRequestError(f"input[{k}].role must be user, system, developer or assistant")
        out.append({"role": role, "content": _content_text(item.get("content"), f"input[{k}].content")})
    return out


def _chat_tool(k: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool (the flat shape) as a chat one."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequestError(f"tools[{k}]: only function tools are supported, not {str(kind)[:40]!r}")
    fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(value: Any) -> Any:
    """tool_choice as chat's: the strings as they are, a named function nested."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise BadRequestError("tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"name\": ...}")


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls as chat's."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequestError("tools must be a list of function tools")
        chat["tools"] = [_chat_tool(k, t) for k, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


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
    if body.get("background"):
        raise BadRequestError("background responses are not supported")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequestError("truncation must be \"disabled\" (prompts are never truncated here)")
    if body.get("conversation") is not None:
        raise BadRequestError("conversations are not supported: use previous_response_id")


def _chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completions body for this request, and the conversation to
    store (without the instructions)."""
    _check_unsupported(body)
    if body.get("input") is None:
        raise BadRequestError("input is required")
    conversation = history + input_messages(body["input"], history)
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
    chat.update(_tool_fields(body))
    fmt = _response_format(body.get("text"))
    if fmt is not None and fmt["type"] != "text":
        chat["response_format"] = fmt
    return chat, conversation


async def create(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    body = parse_json_object(await read_body(request))
    store = optional(body, "store", check_bool, False)
    history: list[dict[str, Any]] = []
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
           conversation: list[dict[str, Any]]) -> None:
    store.put(shaper.id, StoredResponse(response, conversation + [_answer_message(response["output"])]))


def _answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the chat message a follow-up's history holds:
    its text and its complete calls (with the ids the client was given)."""
    text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message" and item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and item["status"] == "completed"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


async def _storing(events: AsyncIterator[NamedEvent], shaper: ResponseShaper, store: ResponseStore,
                   conversation: list[dict[str, Any]]) -> AsyncIterator[NamedEvent]:
    async for name, event in events:
        if name == "response.completed" or name == "response.incomplete":
            _store(store, shaper, event["response"], conversation)
        yield name, event


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Items:
    """The output items of one answer, built from its pieces in order: a
    reasoning item, message items (opened at their first text) and
    function_call items (one per call). Fed a stream's pieces it returns
    their events; fed the whole answer it builds the same items, so a stream
    adds up to the response."""

    def __init__(self, event: Callable[..., NamedEvent]) -> None:
        self.event = event  # makes a numbered event
        self.items: list[dict[str, Any]] = []  # finished items and the open one (its fields so far)
        self.open: str | None = None  # the open item's type
        self.calls: dict[int, int] = {}  # a call's index -> its item's output index

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: dict[str, Any]) -> list[NamedEvent]:
        events = self._close()
        self.items.append(item)
        self.open = item["type"]
        events.append(self.event("response.output_item.added", output_index=self.index, item=self._shown(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part=_text_part("")))
        return events

    def _shown(self, item: dict[str, Any]) -> dict[str, Any]:
        """The item as output_item.added shows it: in progress, nothing in it yet."""
        if item["type"] == "function_call":
            return {**item, "arguments": ""}
        return {**item, "content": []}

    def _close(self, status: str = "completed") -> list[NamedEvent]:
        if self.open is None:
            return []
        item, index = self.items[-1], self.index
        self.open = None
        events: list[NamedEvent] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        else:
            status = item["status"] if item["status"] == "completed" else "incomplete"  # a call cut short
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def add(self, piece: Piece) -> list[NamedEvent]:
        events = self._reasoning(piece.reasoning) if piece.reasoning else []
        for e in piece.events:
            events += self._content_event(e)
        return events

    def _reasoning(self, text: str) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        if self.open != "reasoning":
            events += self._open({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
        item = self.items[-1]
        item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self.index,
                                 content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        if self.open != "message":
            events += self._open_message()
        item = self.items[-1]
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.index,
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def _open_message(self) -> list[NamedEvent]:
        return self._open({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                           "role": "assistant", "content": [_text_part("")]})

    def _content_event(self, e: Event) -> list[NamedEvent]:
        if isinstance(e, Text):
            return self._text(e.text)
        if isinstance(e, CallStart):
            events = self._open({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": e.id,
                                 "name": e.name, "arguments": "", "status": "in_progress"})
            self.calls[e.index] = self.index
            return events
        item = self.items[self.calls[e.index]]
        if isinstance(e, CallArgs):
            item["arguments"] += e.text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self.index, delta=e.text)]
        assert isinstance(e, CallEnd)
        item["status"] = "completed"
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                           name=item["name"], arguments=item["arguments"])] + self._close()

    def finish(self) -> list[NamedEvent]:
        """The end: an answer without text or calls still has its (empty) message."""
        has_answer = any(item["type"] in ("message", "function_call") for item in self.items)
        events = [] if has_answer or self.open == "message" else self._open_message()
        return events + self._close()


class ResponseShaper:
    def __init__(self, run: ChatRun, model: str, body: dict[str, Any]) -> None:
        self.run, self.model, self.body = run, model, body
        self.id = f"resp_{uuid.uuid4().hex}"
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
                "store": bool(b.get("store", False)),
                "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
                "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
                "text": {"format": {"type": "text"}} if not b.get("text") else b["text"],
                "truncation": "disabled", "background": False, "usage": usage}

    def _whole_items(self) -> list[dict[str, Any]]:
        answer = self.run.answer()
        items = _Items(self._numbered)
        items.add(Piece(answer.reasoning, answer.events))
        items.finish()
        return items.items

    def response(self) -> dict[str, Any]:
        status, incomplete = self._status()
        return self._object(status, self._whole_items(), self._usage(), incomplete)

    # ---- streaming -------------------------------------------------------------------

    def _numbered(self, event_name: str, /, **fields: Any) -> NamedEvent:
        self.seq += 1
        return event_name, {"type": event_name, "sequence_number": self.seq - 1, **fields}

    def error_event(self, message: str, status: int) -> NamedEvent:
        err = error_body(message, status, "invalid_request_error" if status == 400 else "server_error")["error"]
        return self._numbered("error", code=str(status), message=err["message"], param=None)

    async def events(self) -> AsyncIterator[NamedEvent]:
        yield self._numbered("response.created", response=self._object("in_progress", []))
        yield self._numbered("response.in_progress", response=self._object("in_progress", []))
        items = _Items(self._numbered)
        async for piece in self.run.pieces():
            for ev in items.add(piece):
                yield ev
        status, incomplete = self._status()
        for ev in items.finish():
            yield ev
        final = self._object(status, items.items, self._usage(), incomplete)
        yield self._numbered("response.completed" if status == "completed" else "response.incomplete",
                             response=final)

