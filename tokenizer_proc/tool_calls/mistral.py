"""Mistral: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`, the calls
of one turn in one JSON list after the `[TOOL_CALLS]` token."""

from __future__ import annotations

from typing import Any

import regex

from tokenizer_proc.tool_calls.base import Event, Text, ToolCallParser
from tokenizer_proc.tool_calls.hermes import arguments_format, call_head
from tokenizer_proc.tool_calls.json_call import JsonCallReader, Outcome
from tokenizer_proc.tool_calls.spec import ToolSpec

TOOL_CALLS = "[TOOL_CALLS]"
_OPEN = regex.compile(r"\s*\[")
_NEXT = regex.compile(r"\s*(,|\])")


class MistralParser(ToolCallParser):
    name = "mistral"
    triggers = (TOOL_CALLS,)
    needs_special_tokens = True  # [TOOL_CALLS] is a special token

    def on_trigger(self) -> None:
        self.opened = False  # the list's "[" was read
        self.reader: JsonCallReader | None = None  # the call being read
        self.between = False  # after a call, before its "," or "]"

    def read_call(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        pos, events = 0, []
        while True:
            if not self.opened:
                m = _OPEN.match(text, pos)
                if m is None:
                    if _OPEN.match(text, pos, partial=True) is not None:  # at the end: a cut call
                        return pos, events, False
                    return pos, events + [Text(TOOL_CALLS)], True  # no list: the marker alone was text
                pos, self.opened = m.end(), True
            if self.reader is None:
                self.reader = JsonCallReader(self)
            if not self.between:
                used, out, outcome = self.reader.read(text[pos:], final)
                pos += used
                events += out
                if outcome is Outcome.RUNNING:
                    return pos, events, False
                if outcome is Outcome.NOT_CALL:
                    return pos, events + [Text(self.reader.raw)], True
                self.between = True  # a call was read: "," or "]" next
            m = _NEXT.match(text, pos)
            if m is None:
                if not final and _NEXT.match(text, pos, partial=True) is not None:
                    return pos, events, False
                return pos, events, True  # a missing "]" is forgiven
            pos = m.end()
            if m.group(1) == "]":
                return pos, events, True
            self.reader, self.between = JsonCallReader(self), False  # "," : the next call

    @classmethod
    def structural_tag(cls, tools: list[ToolSpec], forced: bool, parallel: bool) -> dict[str, Any]:
        tags = [{"type": "tag", "begin": call_head(t.name), "content": arguments_format(t), "end": "}"}
                for t in tools]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel}
        if forced:
            return {"type": "sequence", "elements": [{"type": "const_string", "value": TOOL_CALLS + " ["}, calls,
                                                     {"type": "const_string", "value": "]"}]}
        return {"type": "triggered_tags", "triggers": [TOOL_CALLS], "at_least_one": False,
                "stop_after_first": True,
                "tags": [{"type": "tag", "begin": TOOL_CALLS + " [", "content": calls, "end": "]"}]}
