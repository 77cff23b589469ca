"""Checks every route shares: the API key, the body size limit, and turning
exceptions into the one error shape.

The key and the declared size are checked before any handler runs (and, for
`Expect: 100-continue`, before the client is told to send its body), so an
unauthorized or oversized request costs no body reading at all.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, web

from tokenizer_proc.errors import (ApiError, AuthenticationError, PayloadTooLargeError,
                                   api_error_response, error_response)

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Answer without the API key: load balancer probes, and the dashboard page (it
# holds no data; it asks for the key and sends it with its /timeline calls).
OPEN_PATHS = frozenset({"/health", "/dashboard"})
API_KEY = web.AppKey("api_key", str)  # "" means no key needed
MAX_BODY = web.AppKey("max_body", int)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client errors get their status; anything else is logged and becomes a
    500 for this request alone. aiohttp's own 404/405 get the error shape too."""
    try:
        return await handler(request)
    except ApiError as e:
        return api_error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason, e.status, type(e).__name__.removeprefix("HTTP"))
    except Exception as e:
        logger.exception("error while handling %s %s", request.method, request.path)
        return error_response(f"internal error: {e}", 500, "InternalServerError")


def check_before_body(request: web.Request) -> None:
    """Raises for a missing/wrong API key or a declared oversize body. (A
    chunked body declares nothing; `read_body` caps it while reading.)"""
    key = request.app[API_KEY]
    if key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "").encode("utf-8", "replace")
        # Constant-time comparison: no timing oracle for guessing the key.
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
            raise AuthenticationError("invalid or missing API key (send 'Authorization: Bearer <key>')")
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLargeError(
            f"the request body ({request.content_length} bytes) is larger than the limit "
            f"({limit} bytes)")


@web.middleware
async def gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    check_before_body(request)
    return await handler(request)


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (curl sends it for large bodies): refuse before
    the body is sent, else invite it as aiohttp's default handler does."""
    try:
        check_before_body(request)
    except ApiError as e:
        return api_error_response(e)
    if request.version == HttpVersion11:
        if request.headers.get("Expect", "").lower() != "100-continue":
            return error_response("unsupported Expect header", 417, "ExpectationFailed")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the real response has not started
    return None


async def read_body(request: web.Request) -> bytearray:
    """The body, read with a cap: aiohttp's own limit reads up to the limit
    first, this stops at the first byte too many. A declared length (already
    checked against the cap) is read into one buffer of that size: a 4 MiB
    body costs the event loop no regrowth and no final copy (JSON decodes
    from the buffer)."""
    limit = request.app[MAX_BODY]
    declared = request.content_length
    if declared is not None:
        buf, n = bytearray(declared), 0
        with memoryview(buf) as view:
            async for chunk in request.content.iter_any():
                if n + len(chunk) > declared:  # aiohttp's parser stops at the length; never trust it twice
                    raise PayloadTooLargeError("the request body is longer than its Content-Length")
                view[n:n + len(chunk)] = chunk
                n += len(chunk)
        del buf[n:]  # a body cut short keeps what arrived; its JSON will not parse
        return buf
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLargeError(f"the request body is larger than the limit ({limit} bytes)")
    return buf
