"""Tool calls in a chat answer: the message (`tool_calls`, `content` null when
empty) and the stream's deltas, both from the same parse of the same text,
so the deltas added up are the message.

A call is reported when it is complete. One cut by max_tokens is not a
tool call: the answer's finish_reason is "length" and the message carries
the complete calls and the text only; the stream has already sent the cut
call's name and the arguments written so far (a client accumulating them
sees finish_reason "length" and an unfinished JSON).
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.tool_calls.base import CallArgs, CallStart, Event, ParsedMessage, Text, ToolCallParser
from tokenizer_proc.tools import ToolRequest


def finish_reason_with_calls(reason: str, parsed: ParsedMessage) -> str:
    """OpenAI's "tool_calls" when the model stopped after calling."""
    return "tool_calls" if reason == "stop" and parsed.complete_calls else reason


def message(req: ToolRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """(the message, its finish_reason) of a whole answer."""
    parser = req.new_parser()
    parsed = ParsedMessage().add(parser.feed(text) + parser.finish())
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.complete_calls]
    if calls:
        msg["tool_calls"] = calls
    return msg, finish_reason_with_calls(reason, parsed)


class StreamedCalls:
    """One streamed choice: its parser, and the calls so far."""

    def __init__(self, req: ToolRequest) -> None:
        self.parser: ToolCallParser = req.new_parser()
        self.parsed = ParsedMessage()

    def delta(self, text: str, done: bool) -> dict[str, Any]:
        """The delta for `text` (new output); `done`: it is the last."""
        events = self.parser.feed(text) if text else []
        if done:
            events += self.parser.finish()
        self.parsed.add(events)
        return delta_of(events)


def delta_of(events: list[Event]) -> dict[str, Any]:
    """OpenAI's delta: content, and per call touched its entry (the first with
    id, type and name; argument fragments after)."""
    content = "".join(e.text for e in events if isinstance(e, Text))
    entries: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, CallStart):
            entries[e.index] = {"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, CallArgs):
            entry = entries.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if entries:
        delta["tool_calls"] = list(entries.values())
    return delta
