"""Llama 3.1/3.2 JSON calls: `{"name": "f", "parameters": {...}}`, optionally
after `<|python_tag|>`, several separated by `;`. A call is recognised by its
opening `{"name"` (Meta's templates ask for exactly this JSON), so a JSON
object in prose that is not a call stays text.
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.tool_calls.base import Event, Text, ToolCallParser
from tokenizer_proc.tool_calls.hermes import arguments_format, call_head
from tokenizer_proc.tool_calls.json_call import JsonCallReader, Outcome
from tokenizer_proc.tool_calls.spec import ToolSpec

PYTHON_TAG = "<|python_tag|>"
CALL_OPEN = '{"name"'


class Llama3Parser(ToolCallParser):
    name = "llama3"
    triggers = (PYTHON_TAG, CALL_OPEN)
    kept_triggers = (CALL_OPEN,)
    needs_special_tokens = True  # <|python_tag|> is a special token
    gap = " \t\r\n;"

    def on_trigger(self) -> None:
        self.reader = JsonCallReader(self)

    def read_call(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        pos, events, outcome = self.reader.read(text, final)
        if outcome is Outcome.NOT_CALL:
            return pos, [Text(self.reader.raw)], True
        return pos, events, outcome is Outcome.CALL

    @classmethod
    def structural_tag(cls, tools: list[ToolSpec], forced: bool, parallel: bool) -> dict[str, Any]:
        tags = [{"type": "tag", "begin": call_head(t.name, "parameters"), "content": arguments_format(t),
                 "end": "}"} for t in tools]
        if forced:
            return {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True,
                    "stop_after_first": not parallel}
        return {"type": "triggered_tags", "triggers": ['{"name": '], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}
