"""Small type checks for JSON request bodies, shared by the native and OpenAI
parsers. Each returns the value or raises `BadRequestError` naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenizer_proc.errors import BadRequestError


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequestError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def check_int(name: str, v: Any) -> int:
    if not is_int(v):
        raise BadRequestError(f"{name} must be an integer")
    return v


def check_number(name: str, v: Any) -> float:
    if not (is_int(v) or isinstance(v, float)):
        raise BadRequestError(f"{name} must be a number")
    return float(v)


def check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadRequestError(f"{name} must be a boolean")
    return v


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(name: str, v: Any) -> str:
    """A tenant's label for the prefix cache: requests with different salts
    never share cached prefixes."""
    if not isinstance(v, str) or len(v) > MAX_CACHE_SALT_CHARS:
        raise BadRequestError(f"{name} must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
    return v


def check_int_list(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(is_int(x) for x in v):
        raise BadRequestError(f"{name} must be a list of integers")
    return v


def check_stop(name: str, v: Any) -> list[str]:
    """A stop string or a list of them; none may be empty (it would match at once)."""
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequestError(f"{name} must be a string or a list of strings")
    if any(not s for s in stops):
        raise BadRequestError(f"{name} must not contain an empty string")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequestError(f"{name} may hold at most {MAX_STOP_STRINGS} strings")
    return list(dict.fromkeys(stops))  # drop duplicates, keep order


def check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise BadRequestError(f"{name} must be in [{low}, {high}]")


def optional(body: dict[str, Any], key: str, check: Any, default: Any) -> Any:
    """body[key] checked, or `default` when absent or null (null means "the
    default", as in SGLang's and OpenAI's Python clients)."""
    v = body.get(key)
    return default if v is None else check(key, v)


MAX_STOP_STRINGS = 32
