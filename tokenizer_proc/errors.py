"""Client-facing errors and the one JSON shape they all take.

Every error the HTTP server returns is `{"error": {"message", "type", "code"}}`
(OpenAI's shape, which SGLang uses too), so one client-side parser handles all
of them, whichever route failed.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web


class ApiError(Exception):
    """An error whose message is meant for the client."""

    status = 500
    err_type = "InternalServerError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequestError(ApiError):
    status = 400
    err_type = "BadRequestError"


class AuthenticationError(ApiError):
    status = 401
    err_type = "AuthenticationError"


class PayloadTooLargeError(ApiError):
    status = 413
    err_type = "PayloadTooLargeError"


class ServiceUnavailableError(ApiError):
    status = 503
    err_type = "ServiceUnavailableError"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": status}}


# Anthropic's Messages API routes answer errors in Anthropic's shape
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}: what the `anthropic` client parses."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(message: str, status: int, err_type: str, path: str = "") -> web.Response:
    """The error in OpenAI's shape, or in Anthropic's on its routes."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        return json_response(anthropic_error_body(message, status), status)
    return json_response(error_body(message, status, err_type), status)


def api_error_response(e: ApiError) -> web.Response:
    return error_response(e.message, e.status, e.err_type)
