"""Checks every route shares: the connection bound, what a web page may not
do, the API keys, the body size limit and time, and turning exceptions into
the one error shape.

They run before any handler (and, for `Expect: 100-continue`, before the
client is told to send its body), so a refused request costs no body reading.

Without --api-key, a web page in the user's browser must not drive the
server (a browser adds no key on its own): a request whose Host is not a name
this server answers to is refused (DNS rebinding: a page's own name made to
resolve to us), as is one a browser marks as coming from another site
(`Origin`, `Sec-Fetch-Site`), and so is a POST body declared as anything but
JSON (a page may send text/plain or form bodies anywhere without asking;
application/json needs the server's consent, which we never give). `--allowed-hosts` adds
names, `*` turns the Host and origin checks off.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, web
from yarl import URL

from tokenizer_proc.connections import ConnectionGate
from tokenizer_proc.errors import (ApiError, AuthenticationError, BadRequestError, PayloadTooLargeError,
                                   ServiceUnavailableError, api_error_response, error_response)

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Answer without the API key: load balancer probes, and the dashboard page (it
# holds no data; it asks for the key and sends it with its /timeline calls).
OPEN_PATHS = frozenset({"/health", "/dashboard"})
# Routes that act on every client's requests: with --admin-api-key, that key
# (/abort_request's abort_all is checked in its handler, once the body is read).
ADMIN_PATHS = frozenset({"/flush_cache", "/timeline"})
API_KEY = web.AppKey("api_key", str)  # "" means no key needed
ADMIN_KEY = web.AppKey("admin_api_key", str)  # "" means the ops routes need only API_KEY
MAX_BODY = web.AppKey("max_body", int)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)
GATE = web.AppKey("connection_gate", ConnectionGate)
JSON_TYPE = "application/json"


class ForbiddenError(ApiError):
    status = 403
    err_type = "ForbiddenError"


class RequestTimeoutError(ApiError):
    status = 408
    err_type = "RequestTimeoutError"
    close_connection = True  # the rest of its body may still trickle in: not worth reading


class OverBoundError(ServiceUnavailableError):
    close_connection = True  # the client's next try gets a fresh place in the count


class HostRule:
    """The Host (and Origin) names served without --api-key: the bound host,
    localhost (and *.localhost), any IP address (a page cannot make a browser
    send an address it does not serve from), and --allowed-hosts."""

    def __init__(self, bound_host: str, allowed: str) -> None:
        extra = {n.strip().lower() for n in allowed.split(",") if n.strip()}
        self.any = "*" in extra
        self.names = frozenset({"localhost", bound_host.lower()} | extra)

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:  # no Host at all: HTTP/1.0, never a browser
            return True
        name = host.lower()
        if name.startswith("["):  # [v6 address]:port
            name = name[1:name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.partition(":")[0]
        if name in self.names or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False


HOST_RULE = web.AppKey("host_rule", HostRule)


def _bearer_matches(request: web.Request, key: str) -> bool:
    """`Authorization: Bearer KEY`, or Anthropic's header `x-api-key: KEY`
    (what the `anthropic` client sends)."""
    given = request.headers.get("Authorization", "").encode("utf-8", "replace")
    # Constant-time comparison: no timing oracle for guessing the key.
    bearer = hmac.compare_digest(given, f"Bearer {key}".encode())
    x_api_key = request.headers.get("x-api-key", "").encode("utf-8", "replace")
    return hmac.compare_digest(x_api_key, key.encode()) or bearer


def require_admin(request: web.Request, what: str) -> None:
    """With --admin-api-key, `what` (an action on every client) needs it."""
    admin = request.app[ADMIN_KEY]
    if admin and not _bearer_matches(request, admin):
        raise ForbiddenError(f"{what} needs the admin API key (--admin-api-key; send 'Authorization: Bearer <key>')")


def _origin_authority(origin: str) -> str:
    """host[:port] of an Origin header; "" for "null" (a sandboxed or file:
    page) or one that does not parse."""
    try:
        return URL(origin).raw_authority if origin != "null" else ""
    except ValueError:
        return ""


def check_browser(request: web.Request) -> None:
    """Without --api-key: refuses what a web page could send (module docstring)."""
    rule = request.app[HOST_RULE]
    host = request.headers.get("Host")
    if not rule.allows(host):
        raise ForbiddenError(f"the Host header {host!r} is not a name this server answers to (a web page's "
                             "DNS rebinding?); start the server with --allowed-hosts NAME, or --api-key")
    origin = request.headers.get("Origin")
    if origin is not None and not rule.any and not rule.allows(_origin_authority(origin) or "-"):
        raise ForbiddenError(f"requests from the web page at {origin!r} are refused (it is another site); "
                             "use --allowed-hosts, or --api-key")
    if not rule.any and request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
        raise ForbiddenError("requests a browser sends from another site are refused; use --api-key")
    # A body declared as something else (text/plain, a form: what a page may
    # send anywhere) is refused. None declared is taken: scripts' clients
    # often send none, and a browser marks its cross-site requests (above).
    ctype = request.headers.get("Content-Type")
    has_body = bool(request.content_length) or request.headers.get("Transfer-Encoding") is not None
    if request.method == "POST" and has_body and ctype is not None \
            and ctype.partition(";")[0].strip().lower() != JSON_TYPE:
        raise BadRequestError(f"Content-Type {ctype!r} is not accepted: send the body as {JSON_TYPE}")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client errors get their status; anything else is logged and becomes a
    500 for this request alone. aiohttp's own 404/405 get the error shape too."""
    try:
        return await handler(request)
    except ApiError as e:
        resp = error_response(e.message, e.status, e.err_type, request.path)
        if getattr(e, "close_connection", False):
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason, e.status, type(e).__name__.removeprefix("HTTP"), request.path)
    except Exception as e:
        logger.exception("error while handling %s %s", request.method, request.path)
        return error_response(f"internal error: {e}", 500, "InternalServerError", request.path)


def check_before_body(request: web.Request) -> None:
    """Raises for a connection past the bound, what a web page may not send,
    a missing/wrong API key, or a declared oversize body. (A chunked body
    declares nothing; `read_body` caps it while reading.)"""
    if request.path not in OPEN_PATHS:  # probes and a static page: answered whatever else holds
        gate = request.app[GATE]
        if gate.is_over_bound(request.protocol):
            gate.release(request.protocol)  # answered and closed
            raise OverBoundError(gate.over_bound_message())
        key, admin = request.app[API_KEY], request.app[ADMIN_KEY]
        if not key:
            check_browser(request)
        if admin and request.path in ADMIN_PATHS:
            require_admin(request, request.path)
        elif key and not (_bearer_matches(request, key) or (admin and _bearer_matches(request, admin))):
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
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            return await _read_capped(request)
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s "
                                  "(--body-timeout-s)") from None


async def _read_capped(request: web.Request) -> bytearray:
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
