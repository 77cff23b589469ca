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


def error_response(message: str, status: int, err_type: str) -> web.Response:
    return json_response(error_body(message, status, err_type), status)


def api_error_response(e: ApiError) -> web.Response:
    return error_response(e.message, e.status, e.err_type)
