"""Structured-output fields: parsed into one `Grammar`, checked before anything runs.

Sources, at most one per request: SGLang's `json_schema`, `regex` and `ebnf`
(in `sampling_params` on /generate, top level on the OpenAI routes), and
OpenAI's `response_format` (`json_object`, `json_schema`). Before anything
reaches the scheduler, a grammar over a size bound (`GrammarLimits`: its
characters, a JSON schema's enum values, its nesting depth) or one that does
not parse is a 400 naming the bound or the field. The check parses it with
xgrammar (no vocabulary needed) on a worker thread, so a large schema never
holds up the event loop, and remembers the answer by a hash of the grammar
(never its text: an attacker's large invalid grammars are not kept). The
scheduler compiles it against the vocabulary (scheduler_proc/grammar.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from common.messages import Grammar, GrammarKind
from common.server_args import ServerArgs
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


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """A grammar's size bounds: compile time and compiled size grow with each
    (a schema's enum strings, steeply past a few thousand; the parse with its
    nesting), so they bound one request's share of the scheduler's compiles."""

    max_chars: int
    max_enum_values: int
    max_depth: int

    @classmethod
    def from_args(cls, args: ServerArgs) -> GrammarLimits:
        return cls(args.max_grammar_chars, args.max_grammar_enum_values, args.max_grammar_depth)


def limit_error(grammar: Grammar, limits: GrammarLimits) -> str | None:
    """Which bound the grammar is over, or None; linear in its text, no recursion."""
    name, text = grammar.kind.value, grammar.text
    if len(text) > limits.max_chars:
        return (f"{name} is {len(text)} characters, over the limit of {limits.max_chars} "
                "(--max-grammar-chars)")
    if grammar.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG):
        try:
            schema = json.loads(text)
        except RecursionError:  # nested past the interpreter's own limit
            return f"{name} is nested deeper than the limit of {limits.max_depth} (--max-grammar-depth)"
        except ValueError:
            return None  # not JSON: xgrammar's parse names the error
        depth, enum_values = _json_shape(schema)
        if depth > limits.max_depth:
            return f"{name} is nested {depth} deep, over the limit of {limits.max_depth} (--max-grammar-depth)"
        if enum_values > limits.max_enum_values:
            return (f"{name} has {enum_values} enum/const values, over the limit of "
                    f"{limits.max_enum_values} (--max-grammar-enum-values)")
        return None
    if grammar.kind in (GrammarKind.REGEX, GrammarKind.EBNF):
        depth = _bracket_depth(text, quoted=grammar.kind is GrammarKind.EBNF)
        if depth > limits.max_depth:
            return (f"{name} nests groups {depth} deep, over the limit of {limits.max_depth} "
                    "(--max-grammar-depth)")
    return None


def _json_shape(doc: Any) -> tuple[int, int]:
    """(nesting depth, enum and const values) of a parsed JSON document."""
    max_depth, enum_values = 0, 0
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            max_depth = max(max_depth, depth)
            if isinstance(node.get("enum"), list):
                enum_values += len(node["enum"])
            if "const" in node:
                enum_values += 1
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            max_depth = max(max_depth, depth)
            stack.extend((v, depth + 1) for v in node)
    return max_depth, enum_values


# an escape, a character class, a quoted string (EBNF), or a parenthesis
_GROUPING = re.compile(r"""\\.|\[(?:\\.|[^\]\\])*\]?|"(?:\\.|[^"\\])*"?|'(?:\\.|[^'\\])*'?|[()]""", re.S)
_GROUPING_UNQUOTED = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|[()]", re.S)


def _bracket_depth(text: str, quoted: bool) -> int:
    """How deep a regex's (or an EBNF's) parentheses nest; characters inside
    a class (and an EBNF's quoted strings) are literals."""
    depth = max_depth = 0
    for m in (_GROUPING if quoted else _GROUPING_UNQUOTED).finditer(text):
        token = m.group()
        if token == "(":
            depth += 1
            max_depth = max(max_depth, depth)
        elif token == ")":
            depth = max(0, depth - 1)
    return max_depth


class _VerdictCache:
    """The answers already given, by a hash of the grammar: a client that
    sends the same schema again is not parsed again, and what is kept per
    entry is bounded (a digest and a message cut to MAX_MESSAGE_CHARS)
    whatever the grammar's size."""

    MAX_ENTRIES = 1024
    MAX_MESSAGE_CHARS = 512

    def __init__(self) -> None:
        self._lock = threading.Lock()  # filled from the executor's threads
        self._answers: OrderedDict[tuple[bytes, GrammarLimits], str | None] = OrderedDict()

    @staticmethod
    def key(grammar: Grammar, limits: GrammarLimits) -> tuple[bytes, GrammarLimits]:
        digest = hashlib.sha256(grammar.kind.value.encode() + b"\0" + grammar.text.encode()).digest()
        return digest, limits

    def get(self, key: tuple[bytes, GrammarLimits]) -> tuple[bool, str | None]:
        with self._lock:
            if key not in self._answers:
                return False, None
            self._answers.move_to_end(key)
            return True, self._answers[key]

    def put(self, key: tuple[bytes, GrammarLimits], answer: str | None) -> str | None:
        if answer is not None and len(answer) > self.MAX_MESSAGE_CHARS:
            answer = answer[:self.MAX_MESSAGE_CHARS - 3] + "..."
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > self.MAX_ENTRIES:
                self._answers.popitem(last=False)
        return answer

    def __len__(self) -> int:
        return len(self._answers)

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()


verdicts = _VerdictCache()


def grammar_error(grammar: Grammar, limits: GrammarLimits) -> str | None:
    """Why the grammar cannot be used (a bound it is over, or why it does not
    parse), or None. Remembered by a hash of the grammar."""
    key = verdicts.key(grammar, limits)
    known, answer = verdicts.get(key)
    if known:
        return answer
    return verdicts.put(key, limit_error(grammar, limits) or _parse_error(grammar))


def _parse_error(grammar: Grammar) -> str | None:
    import xgrammar as xgr

    try:
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            xgr.Grammar.from_json_schema(grammar.text, any_whitespace=False)
        elif grammar.kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(grammar.text)
        elif grammar.kind is GrammarKind.EBNF:
            xgr.Grammar.from_ebnf(grammar.text)
        elif grammar.kind is GrammarKind.STRUCTURAL_TAG:
            xgr.Grammar.from_structural_tag(grammar.text)
    except Exception as e:  # xgrammar raises RuntimeError (and subclasses) with the reason
        message = _XGRAMMAR_PREFIX.sub("", str(e).strip())
        return f"invalid {grammar.kind.value}: {message}"
    return None


async def check_grammars(grammars: list[Grammar | None], args: ServerArgs) -> None:
    """Raise a 400 if a grammar is over a bound or does not parse (checked off
    the event loop; the character bound first, on it, so an over-long text
    costs no thread)."""
    limits = GrammarLimits.from_args(args)
    loop = asyncio.get_running_loop()
    for grammar in dict.fromkeys(g for g in grammars if g is not None):
        if len(grammar.text) > limits.max_chars:
            error = limit_error(grammar, limits)
        else:
            error = await loop.run_in_executor(None, grammar_error, grammar, limits)
        if error is not None:
            raise BadRequestError(error)
