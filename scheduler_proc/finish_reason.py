"""Why a request finished, as types (SGLang's FINISH_* classes). The wire
format, and what clients see, is each one's `to_json()`: {"type": "stop",
"matched": ...}, {"type": "length", "length": n}, {"type": "abort",
"message": ..., "status_code"?: 400 or 503}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class FinishMatchedToken:
    """Sampled a stop token (EOS, a stop_token_id, or the end of a grammar)."""

    token: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.token}


@dataclass(frozen=True)
class FinishMatchedStr:
    """The tokenizer process matched a stop string (or stop regex) in the text."""

    text: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.text}


@dataclass(frozen=True)
class FinishLength:
    """max_new_tokens reached, or the context is full."""

    length: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FinishAbort:
    """Ended before its time: by the client, a deadline, a refusal at admission
    (`status_code`: the HTTP status the client gets, 400 or 503), an error."""

    message: str
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


FinishReason = Union[FinishMatchedToken, FinishMatchedStr, FinishLength, FinishAbort]
