"""Structured-output fields: parsed into one `Grammar`, checked before anything runs.

Sources, at most one per request: SGLang's `json_schema`, `regex` and `ebnf`
(in `sampling_params` on /generate, top level on the OpenAI routes), and
OpenAI's `response_format` (`json_object`, `json_schema`). A grammar that
does not parse is a 400 naming the field; the check parses it with xgrammar
(no vocabulary needed) on a worker thread, so a large schema never holds up
the event loop, and remembers the answer by grammar text. The scheduler
compiles it against the vocabulary (scheduler_proc/grammar.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

from common.messages import Grammar, GrammarKind
from tokenizer_proc.errors import BadRequestError

ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON value"
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_from_fields(fields: dict[str, Any], prefix: str = "") -> Grammar | None:
    """`json_schema` (JSON text, or an object), `regex`, `ebnf`: one at most."""
    given = [k for k in ("json_schema", "regex", "ebnf") if fields.get(k) is not None]
    if len(given) > 1:
        raise BadRequestError(f"{prefix}{given[0]} and {prefix}{given[1]} are mutually exclusive: "
                              "one grammar per request")
    if not given:
        return None
    key = given[0]
    value = fields[key]
    if key == "json_schema":
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise BadRequestError(f"{prefix}json_schema must be a JSON schema (a string or an object)")
        if value == ANY_JSON:
            return Grammar(GrammarKind.JSON_ANY)
        return Grammar(GrammarKind.JSON_SCHEMA, value)
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{prefix}{key} must be a non-empty string")
    return Grammar(GrammarKind.REGEX if key == "regex" else GrammarKind.EBNF, value)


def grammar_from_response_format(fmt: Any) -> Grammar | None:
    """OpenAI's response_format: text (no grammar), json_object, json_schema."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequestError("response_format must be an object with a string type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequestError("response_format.json_schema must be an object with a schema")
        schema = spec.get("schema", spec.get("schema_"))  # schema_: SGLang's pydantic alias
        if not isinstance(schema, dict):
            raise BadRequestError("response_format.json_schema.schema must be a JSON schema object")
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    if kind == "structural_tag":
        raise BadRequestError("response_format structural_tag is not supported "
                              "(json_object, json_schema and text are)")
    raise BadRequestError(f"response_format type {kind!r} is not supported "
                          "(text, json_object, json_schema are)")


@functools.lru_cache(maxsize=256)
def grammar_error(grammar: Grammar) -> str | None:
    """Why the grammar cannot be used, or None. Cached by grammar text."""
    import xgrammar as xgr

    try:
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            xgr.Grammar.from_json_schema(grammar.text, any_whitespace=False)
        elif grammar.kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(grammar.text)
        elif grammar.kind is GrammarKind.EBNF:
            xgr.Grammar.from_ebnf(grammar.text)
    except Exception as e:  # xgrammar raises RuntimeError (and subclasses) with the reason
        message = _XGRAMMAR_PREFIX.sub("", str(e).strip())
        return f"invalid {grammar.kind.value}: {message}"
    return None


async def check_grammars(grammars: list[Grammar | None]) -> None:
    """Raise a 400 if a grammar does not parse (checked off the event loop)."""
    loop = asyncio.get_running_loop()
    for grammar in dict.fromkeys(g for g in grammars if g is not None):
        error = await loop.run_in_executor(None, grammar_error, grammar)
        if error is not None:
            raise BadRequestError(error)
