"""What a client sees of a finish reason (common/messages.py's typed ones):
its JSON (`meta_info.finish_reason`), and, for an abort, the HTTP status it
is answered with. The one place either is decided."""

from __future__ import annotations

from typing import Any

from common.messages import AbortKind, FinishAbort, FinishLength, FinishMatchedStr, FinishMatchedToken, FinishReason
from tokenizer_proc.errors import ApiError, BadRequestError, ServiceUnavailableError

# The HTTP status of a request whose answer is its abort (the OpenAI routes'
# answer to any abort): 503 where the client may retry later.
ABORT_STATUS: dict[AbortKind, int] = {
    AbortKind.QUEUE_FULL: 503,
    AbortKind.SERVER_DOWN: 503,
    AbortKind.SHUTDOWN: 503,
    AbortKind.INVALID: 400,
    AbortKind.DEADLINE: 400,
    AbortKind.CLIENT_GONE: 400,
    AbortKind.SERVER_ERROR: 400,
}
# Aborts that refuse the request outright: native /generate answers one with
# its status when nothing was generated (not a 200 with an abort), and its
# JSON names the status (`status_code`).
REFUSALS = frozenset({AbortKind.QUEUE_FULL, AbortKind.INVALID, AbortKind.SERVER_DOWN})


def finish_json(reason: FinishReason | None) -> dict[str, Any] | None:
    """{"type": "stop", "matched": id or text}, {"type": "length", "length":
    n} or {"type": "abort", "message": text, "status_code"?: 400 or 503}."""
    if reason is None:
        return None
    if isinstance(reason, FinishMatchedToken):
        return {"type": "stop", "matched": reason.token}
    if isinstance(reason, FinishMatchedStr):
        return {"type": "stop", "matched": reason.text}
    if isinstance(reason, FinishLength):
        return {"type": "length", "length": reason.length}
    out: dict[str, Any] = {"type": "abort", "message": reason.message}
    if reason.kind in REFUSALS:
        out["status_code"] = ABORT_STATUS[reason.kind]
    return out


def matched(reason: FinishReason | None) -> int | str | None:
    """The stop token id or stop string that ended the request (None: another reason)."""
    if isinstance(reason, FinishMatchedToken):
        return reason.token
    if isinstance(reason, FinishMatchedStr):
        return reason.text
    return None


def abort_error(reason: FinishAbort) -> ApiError:
    """The error a route answers an abort with, when the abort is its answer."""
    if ABORT_STATUS[reason.kind] == 503:
        return ServiceUnavailableError(reason.message or "the server is overloaded")
    return BadRequestError(f"the request was aborted: {reason.message}")


def refusal_error(reason: FinishReason | None) -> ApiError | None:
    """The error a refusal at admission is answered with (None: not a refusal)."""
    if not isinstance(reason, FinishAbort) or reason.kind not in REFUSALS:
        return None
    if ABORT_STATUS[reason.kind] == 503:
        return ServiceUnavailableError(reason.message or "the server is overloaded")
    return BadRequestError(reason.message or "the request cannot run")
