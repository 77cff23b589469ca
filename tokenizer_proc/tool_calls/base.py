"""What every tool-call format shares: the events a parser emits, the
incremental text scanner that holds back a possible trigger, and the
message a finished parse adds up to.

A parser is fed the generated text in pieces (`feed`) and returns events:
`Text` (content), `CallStart` (a call's index, id and name) and `CallArgs`
(a fragment of its arguments' JSON text), `CallEnd` (the call is complete).
Events depend only on the text, never on how it was split: fed in any
pieces, their texts and argument fragments concatenate to the one-shot
parse. Text that could still turn out to be the start of a call (a prefix
of the trigger, whitespace before a call) is held back until it is decided,
so no markup ever reaches the content.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenizer_proc.tool_calls.spec import ToolSpec


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    text: str  # a fragment of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int


Event = Text | CallStart | CallArgs | CallEnd


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedMessage:
    """Events added up: what a non-streamed answer reports."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> ParsedMessage:
        for e in events:
            if isinstance(e, Text):
                self.content += e.text
            elif isinstance(e, CallStart):
                self.calls.append(ParsedCall(e.id, e.name))
            elif isinstance(e, CallArgs):
                self.calls[e.index].arguments += e.text
            else:
                self.calls[e.index].complete = True
        return self

    @property
    def complete_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if c.complete]

    @property
    def cut_call(self) -> bool:
        """A call started and did not finish (max_tokens cut it)."""
        return any(not c.complete for c in self.calls)


class ToolCallParser(ABC):
    """One request's parse of one format. Subclasses say what a trigger is
    (`triggers`) and read a call's body once one is met (`read_call`)."""

    name: ClassVar[str]
    triggers: ClassVar[tuple[str, ...]]
    # the trigger is a special token: the request must keep special tokens in its text
    needs_special_tokens: ClassVar[bool] = False
    gap: ClassVar[str] = " \t\r\n"  # characters between calls (and before the first): never content
    kept_triggers: ClassVar[tuple[str, ...]] = ()  # triggers that are the call's own first characters

    def __init__(self, tool_names: list[str] | None = None) -> None:
        self.tool_names = tool_names  # the request's functions (None: any name)
        self.buf = ""  # text not yet decided
        self.in_call = False  # after a trigger, until the call (or calls) it opened end
        self.calls = 0  # calls started
        self.after_call = False  # no content since the last call
        self.shown = False  # some content was emitted
        self.region_first_call = 0  # self.calls when the current trigger was met
        self.region_ends_in_text = False  # the current region's last event was text
        self.cut = False  # finish() met an unfinished call

    # ---- the caller's side ----------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        """The end of the output: hold nothing back. An unfinished call is
        left without its CallEnd (and its held markup is dropped)."""
        events = self._advance(final=True)
        if self.in_call:
            self.cut = True
            self.buf = ""
            return events
        text = self.buf
        self.buf = ""
        if text and not (self.calls and text.strip(self.gap) == ""):
            events.append(Text(text))  # a trigger's prefix is text after all; a gap after calls is not
        return events

    # ---- the scan ------------------------------------------------------------------

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.in_call:
                consumed, out, done = self.read_call(self.buf, final)
                self.buf = self.buf[consumed:]
                events += out
                if out:
                    self.region_ends_in_text = isinstance(out[-1], Text)
                    if any(isinstance(e, Text) for e in out):
                        self.shown = True  # the region was not a call after all (or not all of it)
                if not done:
                    return events
                self.in_call = False
                self.after_call = self.calls > self.region_first_call and not self.region_ends_in_text
                continue
            pos, length, kept = self.find_trigger(self.buf)
            if pos < 0:
                self._decide_text(events, self._undecided_from(self.buf), before_call=False)
                return events
            self._decide_text(events, pos, before_call=True)
            self.buf = self.buf[0 if kept else length:]
            self.in_call = True
            self.region_first_call, self.region_ends_in_text = self.calls, False
            self.on_trigger()

    def _decide_text(self, events: list[Event], end: int, before_call: bool) -> None:
        """buf[:end] is not markup: emit it as content, except the gap
        characters right after a call (dropped) and those at its end (held:
        a call may follow; dropped when one does)."""
        region = self.buf[:end]
        # after a call, a gap is dropped unless content came before it (then it separates the two)
        lead = len(region) - len(region.lstrip(self.gap)) if self.after_call and not self.shown else 0
        shown = region[lead:].rstrip(self.gap)
        if shown:
            events.append(Text(shown))
            self.after_call, self.shown = False, True
        self.buf = self.buf[end if before_call else lead + len(shown):]

    def _undecided_from(self, text: str) -> int:
        """Where the part of `text` that may still begin a call starts: a
        trigger's prefix at its end."""
        for start in range(max(0, len(text) - self.longest_trigger + 1), len(text)):
            if self.could_start(text[start:]):
                return start
        return len(text)

    @property
    def longest_trigger(self) -> int:
        return max(len(t) for t in self.triggers)

    def find_trigger(self, text: str) -> tuple[int, int, bool]:
        """(position, length, kept) of the first trigger in `text`, or (-1, 0,
        False); a kept trigger is the call's own first characters (llama3's
        `{"name"`), left for `read_call`."""
        best = (-1, 0, False)
        for t in self.triggers:
            pos = text.find(t)
            if pos >= 0 and (best[0] < 0 or pos < best[0]):
                best = (pos, len(t), t in self.kept_triggers)
        return best

    def could_start(self, tail: str) -> bool:
        return any(t.startswith(tail) for t in self.triggers)

    def on_trigger(self) -> None:
        """A trigger was consumed: reset the call reader."""

    @abstractmethod
    def read_call(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        """Read from `text` (what follows the trigger, as far as it has come):
        (characters consumed, events, whether the call region ended)."""

    # ---- helpers for subclasses -----------------------------------------------------------

    def start_call(self, name: str) -> CallStart:
        event = CallStart(self.calls, call_id(), name)
        self.calls += 1
        return event

    # ---- the grammar ---------------------------------------------------------------

    @classmethod
    @abstractmethod
    def structural_tag(cls, tools: list[ToolSpec], forced: bool, parallel: bool) -> dict[str, Any]:
        """xgrammar's structural tag (its `format`) for these tools: with `forced`,
        calls only (at least one; several with `parallel`); else free text in
        which each trigger opens a call that must then be complete and valid."""

