"""Server-sent events with names: `event: <name>\ndata: <json>\n\n`, as
Anthropic's Messages API and OpenAI's Responses API stream (no `[DONE]`).

An error after the headers goes into the stream as the API's own error
event (`error_event` builds it); a client that hung up gets nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from tokenizer_proc.errors import ApiError
from tokenizer_proc.sse import client_gone

logger = logging.getLogger(__name__)

NamedEvent = tuple[str, dict[str, Any]]


def named_sse(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


async def stream_named_events(request: web.Request, events: AsyncIterator[NamedEvent], what: str,
                              error_event: Callable[[str, int], NamedEvent]) -> web.StreamResponse:
    """Writes each (name, object) of `events`; `what` names the request in logs;
    `error_event(message, status)` is the event an error becomes."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for name, obj in events:
            await resp.write(named_sse(name, obj))
    except Exception as e:
        if client_gone(request):
            logger.info("client of %s went away", what)
            return resp
        if isinstance(e, ApiError):
            name, obj = error_event(e.message, e.status)
        else:
            logger.exception("error while streaming %s", what)
            name, obj = error_event(f"internal error: {e}", 500)
        await resp.write(named_sse(name, obj))
    await resp.write_eof()
    return resp
