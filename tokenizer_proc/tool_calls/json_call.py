"""Reading one JSON-shaped call, `{"name": "f", "arguments": {...}}`, as it
arrives (hermes, qwen25, llama3 and mistral all write calls this way).

The head up to the arguments is matched as soon as it is complete (the
call's name is then known and announced); the arguments' JSON text is then
passed on a fragment at a time, as far as a scanner of JSON nesting shows
it belongs to the value; the closing brace ends the call. A body written
some other way (keys in another order, unconstrained output) is read whole
and parsed; if it is not a call after all, it is given back as text.
"""

from __future__ import annotations

import enum
import json

import regex

from tokenizer_proc.tool_calls.base import CallArgs, CallEnd, Event, ToolCallParser

_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_TAIL = regex.compile(r"\s*\}")
_SPACE = " \t\r\n"
_CONTROL = {chr(c): json.dumps(chr(c))[1:-1] for c in range(0x20)}


def escape_controls(fragment: str, scanner: JsonValueScanner) -> str:
    """`fragment` (just scanned) with the raw control characters inside its
    strings written as JSON escapes. xgrammar's string rule for a schema with
    minLength/maxLength lets a tab or other control character through, which
    strict JSON parsers (Python's, the clients') refuse; escaped, the value
    is the one the model wrote."""
    if not scanner.control:
        return fragment
    scanner.control = False
    out, in_string, escaped = [], scanner.entry_in_string, scanner.entry_escaped
    for ch in fragment:
        if in_string and ch < " ":
            out.append(_CONTROL[ch])
            continue
        out.append(ch)
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
    return "".join(out)


def _unquote(body: str) -> str:
    """A JSON string's body decoded (as written, if its escapes are not JSON's)."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return body


class JsonValueScanner:
    """Where a JSON value ends, fed in pieces: nesting depth, strings and
    their escapes tracked; nothing parsed."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.scalar = False  # a number or a literal: it ends at a delimiter
        self.done = False
        self.control = False  # a raw control character was met inside a string
        self.entry_in_string = self.entry_escaped = False  # the string state where the last scan began

    def mark(self) -> None:
        self.entry_in_string, self.entry_escaped = self.in_string, self.escaped

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them
        unless it ends inside)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if ch < " ":
                    self.control = True
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if not self.started:
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_string = True
                else:
                    self.scalar = True
                continue
            if self.scalar:
                if ch in ",}]" or ch in _SPACE:
                    self.done = True
                    return i
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class Stage(enum.Enum):
    HEAD = "head"  # before the arguments: waiting for the name
    ARGS = "args"  # inside the arguments' value
    TAIL = "tail"  # after it: the closing brace
    WHOLE = "whole"  # a body not in the usual shape: read whole, then parsed


class Outcome(enum.Enum):
    RUNNING = "running"
    CALL = "call"  # a call was read (its events emitted)
    NOT_CALL = "not a call"  # the body is not a call: `raw` is its text


class JsonCallReader:
    """One call; `read` returns (consumed, events, outcome)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.stage = Stage.HEAD
        self.scanner = JsonValueScanner()
        self.index = -1
        self.raw = ""  # WHOLE: the body so far

    def read(self, text: str, final: bool) -> tuple[int, list[Event], Outcome]:
        events: list[Event] = []
        pos = 0
        if self.stage is Stage.HEAD:
            m = _HEAD.match(text)
            if m is not None:
                start = self.parser.start_call(_unquote(m.group(1)))
                self.index = start.index
                events.append(start)
                pos = m.end()
                self.stage = Stage.ARGS
            elif not final and _HEAD.match(text, partial=True) is not None:
                return 0, events, Outcome.RUNNING
            else:
                self.stage = Stage.WHOLE
        if self.stage is Stage.ARGS:
            if not self.scanner.started:
                rest = text[pos:]
                pos += len(rest) - len(rest.lstrip(_SPACE))
            self.scanner.mark()
            taken = self.scanner.scan(text[pos:])
            if taken:
                events.append(CallArgs(self.index, escape_controls(text[pos:pos + taken], self.scanner)))
            pos += taken
            if not self.scanner.done and not (final and self.scanner.scalar):
                return pos, events, Outcome.RUNNING
            self.stage = Stage.TAIL
        if self.stage is Stage.TAIL:
            m = _TAIL.match(text, pos)
            if m is None and not final and _TAIL.match(text, pos, partial=True) is not None:
                return pos, events, Outcome.RUNNING
            if m is not None:
                pos = m.end()
            events.append(CallEnd(self.index))  # a missing brace is forgiven: the arguments are whole
            return pos, events, Outcome.CALL
        return self._read_whole(text, final)

    def _read_whole(self, text: str, final: bool) -> tuple[int, list[Event], Outcome]:
        """The body as one JSON value, parsed when it ends."""
        if not self.scanner.started:
            lead = len(text) - len(text.lstrip(_SPACE))
            self.raw += text[:lead]
            text = text[lead:]
            consumed = lead
        else:
            consumed = 0
        taken = self.scanner.scan(text)
        self.raw += text[:taken]
        consumed += taken
        if not self.scanner.done:  # at the end of the output too: a cut call, not text
            return consumed, [], Outcome.RUNNING
        try:
            value = json.loads(self.raw, strict=False)  # control characters in strings: see escape_controls
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return consumed, [], Outcome.NOT_CALL
        args = value.get("arguments", value.get("parameters", {}))
        if not isinstance(args, dict):
            return consumed, [], Outcome.NOT_CALL
        start = self.parser.start_call(value["name"])
        return consumed, [start, CallArgs(start.index, json.dumps(args, ensure_ascii=False)),
                          CallEnd(start.index)], Outcome.CALL
