"""Small type checks for JSON request bodies, shared by the native and OpenAI
parsers. Each returns the value or raises `BadRequestError` naming the field."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.stop_strings import compile_stop_regex


# Deeper JSON than this is refused: every later step (validation, repr in an
# error message, the grammar compiler, encoding an answer) may recurse once
# per level, and Python's recursion limit is shared by the whole stack.
MAX_JSON_DEPTH = 128
_TOO_DEEP = f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"


def parse_json_object(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequestError(f"malformed JSON body: {e}") from None
    except RecursionError:  # the decoder's own guard, at Python's recursion limit
        raise BadRequestError(_TOO_DEEP) from None
    # Fewer brackets than the bound cannot nest past it: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise BadRequestError(_TOO_DEEP)
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, (list, dict)):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break  # deep enough to refuse: no need to read the rest
        stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v)
                     if isinstance(c, (list, dict)))
    return deepest


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def check_int(name: str, v: Any) -> int:
    if not is_int(v):
        raise BadRequestError(f"{name} must be an integer")
    return v


def check_number(name: str, v: Any) -> float:
    if not (is_int(v) or isinstance(v, float)):
        raise BadRequestError(f"{name} must be a number")
    try:
        return float(v)
    except OverflowError:  # an integer with hundreds of digits
        raise BadRequestError(f"{name} is too large: it must fit a 64-bit float") from None


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


def cache_namespace(cache_salt: str, extra_key: str) -> str:
    """SGLang's extra_key joins cache_salt: requests that differ in either never
    share cached prefixes."""
    return cache_salt if not extra_key else f"{cache_salt}\x00{extra_key}"


MAX_TOKEN_ID_DIGITS = 10  # a token id is below 2**31


def is_decimal(text: Any, max_digits: int) -> bool:
    """ASCII digits only: str.isdigit() is also true of "²" and "١", which
    int() refuses or reads as another number."""
    return isinstance(text, str) and 0 < len(text) <= max_digits and text.isascii() and text.isdigit()


def check_logit_bias(name: str, v: Any, limit: float | None = None) -> dict[int, float]:
    """A JSON object token id (a string of digits, as JSON keys are) -> a
    finite number added to that token's logit (within +-limit if given)."""
    if not isinstance(v, dict):
        raise BadRequestError(f"{name} must be an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not is_decimal(key, len(key)):
            raise BadRequestError(f"{name}: key {key[:40]!r} is not a token id")
        if len(key) > MAX_TOKEN_ID_DIGITS:  # before int(): it refuses over 4,300 digits
            raise BadRequestError(f"{name}: token ids must be below 2**31 (not {key[:20]}...)")
        bias = check_number(f"{name}[{key!r}]", bias)
        if not math.isfinite(bias) or (limit is not None and not -limit <= bias <= limit):
            bound = f"in [-{limit:g}, {limit:g}]" if limit is not None else "finite"
            raise BadRequestError(f"{name}[{key!r}] must be {bound}")
        out[int(key)] = bias
    return out


def check_stop_regex(name: str, v: Any) -> list[str]:
    """A regular expression or a list of them, each one that can end a text."""
    patterns = [v] if isinstance(v, str) else v
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise BadRequestError(f"{name} must be a string or a list of strings")
    if len(patterns) > MAX_STOP_STRINGS:
        raise BadRequestError(f"{name} may hold at most {MAX_STOP_STRINGS} patterns")
    for p in patterns:
        try:
            compile_stop_regex(p)
        except ValueError as e:
            raise BadRequestError(f"{name}: {p!r}: {e}") from None
    return list(dict.fromkeys(patterns))


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
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequestError(f"{name}: a stop string may have at most {MAX_STOP_CHARS} characters")
    return list(dict.fromkeys(stops))  # drop duplicates, keep order


MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(name: str, v: Any) -> float:
    """A request's deadline in seconds: positive and finite (at most a week)."""
    t = check_number(name, v)
    if not 0 < t <= MAX_TIMEOUT_S:
        raise BadRequestError(f"{name} must be in (0, {MAX_TIMEOUT_S:.0f}] seconds")
    return t


MAX_PRIORITY = 2**31 - 1


def check_priority(name: str, v: Any) -> int:
    p = check_int(name, v)
    if not -MAX_PRIORITY <= p <= MAX_PRIORITY:
        raise BadRequestError(f"{name} must be in [{-MAX_PRIORITY}, {MAX_PRIORITY}]")
    return p


def check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise BadRequestError(f"{name} must be in [{low}, {high}]")


def optional(body: dict[str, Any], key: str, check: Any, default: Any) -> Any:
    """body[key] checked, or `default` when absent or null (null means "the
    default", as in SGLang's and OpenAI's Python clients)."""
    v = body.get(key)
    return default if v is None else check(key, v)


MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # text that may begin a stop string is held back: at most this much
MAX_RID_CHARS = 256


def check_rid(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_RID_CHARS:
        raise BadRequestError(f"{name} must be a non-empty string of at most {MAX_RID_CHARS} characters")
    return v


def check_prompt_chars(name: str, text: str, limit: int | None) -> None:
    """Refuses, before tokenizing, a prompt too long to fit the context whatever
    its tokens: `limit` is the context length times the most characters one
    token can stand for (`prompt_char_limit`)."""
    if limit is not None and len(text) > limit:
        raise BadRequestError(
            f"{name} has {len(text)} characters, more than can fit the model's context "
            f"(at most {limit}: the context length times the longest token's characters); "
            "it was refused before tokenizing")


def prompt_char_limit(context_len: int, max_token_chars: int | None) -> int | None:
    """The most characters a prompt that fits `context_len` tokens can have
    (None: the tokenizer does not say, and only the body size bounds it)."""
    return None if not max_token_chars else context_len * max_token_chars
