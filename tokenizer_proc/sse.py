"""Server-sent events: `data: <json>\n\n` per event, then `data: [DONE]\n\n`.

Once the headers are out an error can no longer change the status, so it goes
into the stream as an event in the error shape (the `openai` client raises it).
A client that hung up gets nothing more; the caller's `finally` aborts its
requests.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from tokenizer_proc.errors import ApiError, error_body

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def stream_events(request: web.Request, events: AsyncIterator[Any], what: str) -> web.StreamResponse:
    """Writes each object of `events` as an SSE event; `what` names the request in logs."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for obj in events:
            await resp.write(sse(obj))
    except Exception as e:
        if client_gone(request):
            logger.info("client of %s went away", what)
            return resp  # nothing to tell it
        if isinstance(e, ApiError):
            body = error_body(e.message, e.status, e.err_type)
        else:
            logger.exception("error while streaming %s", what)
            body = error_body(f"internal error: {e}", 500, "InternalServerError")
        await resp.write(sse(body))
    await resp.write(DONE)
    await resp.write_eof()
    return resp
