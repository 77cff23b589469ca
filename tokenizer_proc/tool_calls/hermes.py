"""Hermes (and Qwen 2.5, `qwen25`): each call in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with text allowed before, between and after the blocks. The format of
ChatML models' tool templates (Qwen 2.5's, and the one this server ships
for the ChatML family).
"""

from __future__ import annotations

import json
from typing import Any

import regex

from tokenizer_proc.tool_calls.base import Event, Text, ToolCallParser
from tokenizer_proc.tool_calls.json_call import JsonCallReader, Outcome
from tokenizer_proc.tool_calls.spec import ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CLOSE = regex.compile(r"\s*</tool_call>")


def call_head(name: str, args_key: str = "arguments") -> str:
    """What a constrained call writes before its arguments (the parser reads any spacing)."""
    return '{"name": ' + json.dumps(name) + f', "{args_key}": '


def arguments_format(tool: ToolSpec) -> dict[str, Any]:
    # one space at most between JSON tokens: a small model otherwise pads with newlines
    return {"type": "json_schema", "json_schema": tool.parameters, "max_whitespace_cnt": 1}


class HermesParser(ToolCallParser):
    name = "hermes"
    triggers = (OPEN,)

    def on_trigger(self) -> None:
        self.reader = JsonCallReader(self)
        self.closing = False  # the call was read: its closing tag is next

    def read_call(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        pos, events = 0, []
        if not self.closing:
            pos, events, outcome = self.reader.read(text, final)
            if outcome is Outcome.RUNNING:
                return pos, events, False
            if outcome is Outcome.NOT_CALL:
                return pos, [Text(OPEN + self.reader.raw)], True
            self.closing = True
        m = _CLOSE.match(text, pos)
        if m is None and not final and _CLOSE.match(text, pos, partial=True) is not None:
            return pos, events, False
        return (m.end() if m is not None else pos), events, True  # a missing close tag is forgiven

    @classmethod
    def structural_tag(cls, tools: list[ToolSpec], forced: bool, parallel: bool) -> dict[str, Any]:
        tags = [{"type": "tag", "begin": f"{OPEN}\n{call_head(t.name)}", "content": arguments_format(t),
                 "end": "}\n" + CLOSE} for t in tools]
        if forced:
            return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                    "stop_after_first": not parallel}
        return {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}


class Qwen25Parser(HermesParser):
    """SGLang's name for the same format."""

    name = "qwen25"
