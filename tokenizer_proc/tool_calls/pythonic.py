"""Pythonic calls (Llama 3.2/4's other format): a Python list of calls with
keyword arguments, `[get_weather(city="Paris"), get_time(zone="CET")]`.

The list is read whole (to its closing bracket, outside strings) and
parsed with `ast`; each call's keyword arguments (Python or JSON literals:
`True`/`true`, `None`/`null`) become its arguments' JSON. Calls are
therefore announced when the list closes, each with all its arguments in
one fragment. A bracketed text that does not parse as calls stays text.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import regex

from tokenizer_proc.tool_calls.base import CallArgs, CallEnd, Event, Text, ToolCallParser
from tokenizer_proc.tool_calls.spec import ToolSpec

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """[(name, arguments)] of a Python list of calls, or None."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
                return None
            calls.append((ast.unparse(call.func), {k.arg: _literal(k.value) for k in call.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicParser(ToolCallParser):
    name = "pythonic"
    triggers = ("[",)  # with a name and "(" after it (find_trigger)

    def __init__(self, tool_names: list[str] | None = None) -> None:
        super().__init__(tool_names)
        # with the request's functions known, only a list opening with one of them is a call (as
        # the grammar for "auto" has it); else any name
        names = "|".join(regex.escape(n) for n in tool_names) if tool_names else r"[A-Za-z_][\w.]*"
        self.trigger = regex.compile(rf"\[\s*(?:{names})\(")

    def find_trigger(self, text: str) -> tuple[int, int, bool]:
        m = self.trigger.search(text)
        return (m.start(), 0, True) if m else (-1, 0, False)

    def _undecided_from(self, text: str) -> int:
        start = text.rfind("[")
        while start >= 0:
            if self.trigger.fullmatch(text, start, partial=True):
                return start
            start = text.rfind("[", 0, start)
        return len(text)

    def on_trigger(self) -> None:
        self.depth = 0
        self.quote = ""  # the open string's quote character
        self.escaped = False
        self.scanned = 0  # characters of the list read so far

    def read_call(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        i = self.scanned
        while i < len(text):
            ch = text[i]
            i += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "[({":
                self.depth += 1
            elif ch in "])}":
                self.depth -= 1
                if self.depth == 0:
                    return i, self._calls(text[:i]), True
        self.scanned = i
        return 0, [], False  # the list is read whole: nothing is consumed before its end

    def _calls(self, source: str) -> list[Event]:
        calls = parse_calls(source)
        if calls is None:
            return [Text(source)]
        events: list[Event] = []
        for name, args in calls:
            start = self.start_call(name)
            events += [start, CallArgs(start.index, json.dumps(args, ensure_ascii=False)), CallEnd(start.index)]
        return events

    @classmethod
    def structural_tag(cls, tools: list[ToolSpec], forced: bool, parallel: bool) -> dict[str, Any]:
        if forced:
            tags = [{"type": "tag", "begin": f"{t.name}(", "content": keyword_arguments(t), "end": ")"}
                    for t in tools]
            return {"type": "sequence", "elements": [
                {"type": "const_string", "value": "["},
                {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel},
                {"type": "const_string", "value": "]"}]}
        tags = [{"type": "tag", "begin": f"[{t.name}(", "content": keyword_arguments(t), "end": ")]"}
                for t in tools]
        return {"type": "triggered_tags", "triggers": [f"[{t.name}(" for t in tools], "tags": tags,
                "at_least_one": False, "stop_after_first": not parallel}


def keyword_arguments(tool: ToolSpec) -> dict[str, Any]:
    """Every property of the tool's schema, in its order, as `name=<JSON
    value>` (JSON literals are Python ones but for true/false/null, which the
    parser reads). Optional properties are written too: the grammar stays a
    plain sequence, and the arguments still validate."""
    schema = tool.parameters
    props = schema.get("properties") or {}
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    elements: list[dict[str, Any]] = []
    for k, (key, sub) in enumerate(props.items()):
        elements.append({"type": "const_string", "value": f"{', ' if k else ''}{key}="})
        sub = {**sub, **defs} if isinstance(sub, dict) else sub
        elements.append({"type": "json_schema", "json_schema": sub, "max_whitespace_cnt": 1})
    if not elements:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": elements}
