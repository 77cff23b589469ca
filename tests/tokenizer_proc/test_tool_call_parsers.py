"""Each tool-call format's parser on recorded outputs: the one-shot parse
finds the calls and the content; fed in pieces split at every character, at
every byte of the UTF-8 text (through an incremental decoder, as a stream
of tokens gives it), and one character at a time, the events add up to the
one-shot parse and no markup ever reaches the content. Each format's
grammar (xgrammar's structural tag) accepts the format's calls and refuses
a call of an unknown function or with arguments outside the schema."""

from __future__ import annotations

import codecs
import random
import json
from dataclasses import dataclass
from typing import Any

import pytest
import xgrammar as xgr

from common.server_args import TOOL_CALL_PARSERS
from tokenizer_proc.tool_calls import PARSERS
from tokenizer_proc.tool_calls.base import CallArgs, CallEnd, CallStart, Event, ParsedMessage, Text, ToolCallParser
from tokenizer_proc.tool_calls.spec import ToolSpec

MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '{"name"', "get_weather(")


@dataclass(frozen=True)
class Recorded:
    parser: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    cut: bool = False  # ends inside a call (max_tokens)


RECORDED = [
    Recorded("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    Recorded("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
             "</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    Recorded("hermes", 'Let me check. \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
             '"days": [1, 2], "note": "a \\"quoted\\" } brace"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}\n</tool_call>',
             "Let me check.", [("get_weather", {"city": "Zürich", "days": [1, 2], "note": 'a "quoted" } brace'}),
                               ("get_time", {"tz": "Europe/Zurich"})]),
    Recorded("hermes", '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call> Done, <tool!',
             "Done, <tool!", [("get_time", {"tz": "UTC"})]),
    Recorded("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "Sure.",
             [("get_weather", {})], cut=True),
    # a raw tab inside a string (xgrammar lets one through where a schema bounds the length):
    # escaped, so the arguments are strict JSON
    Recorded("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "to_\tdate", "n": ["\\"\x01"]}}\n'
             "</tool_call>", "", [("get_time", {"tz": "to_\tdate", "n": ['"\x01']})]),
    Recorded("hermes", '<tool_call>{"name": "get_\\q\\u00e9", "arguments": {}}</tool_call>', "",
             [("get_\\q\\u00e9", {})]),  # a name whose escapes are not JSON's: kept as written
    Recorded("qwen25", 'Checking…\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
             "Checking…", [("get_time", {})]),
    Recorded("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
             "", [("get_weather", {"city": "Paris"})]),
    Recorded("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
             '"parameters": {"tz": "CET"}}', "", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    Recorded("llama3", "Use {braces} freely, and {\"x\": 1} too.", "Use {braces} freely, and {\"x\": 1} too.", []),
    Recorded("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", '
             '"arguments": {"tz": "CET"}}]', "", [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
    Recorded("mistral", 'Hmm [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Hmm",
             [("get_time", {"tz": "UTC"})]),
    Recorded("mistral", "Lists like [1, 2] and [TOOL are text.", "Lists like [1, 2] and [TOOL are text.", []),
    Recorded("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz=\'CET\', exact=true)]', "",
             [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET", "exact": True})]),
    Recorded("pythonic", 'I will look: [get_time(tz="a]b")] and [1, 2] stays.', "I will look: and [1, 2] stays.",
             [("get_time", {"tz": "a]b"})]),
    Recorded("pythonic", "[not_a_call(1 +)] is text", "[not_a_call(1 +)] is text", []),
]


def normalise(events: list[Event]) -> list[tuple[Any, ...]]:
    """Adjacent text joined, adjacent argument fragments of a call joined, ids dropped."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, Text):
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + e.text)
            else:
                out.append(("text", e.text))
        elif isinstance(e, CallArgs):
            if out and out[-1][0] == "args" and out[-1][1] == e.index:
                out[-1] = ("args", e.index, out[-1][2] + e.text)
            else:
                out.append(("args", e.index, e.text))
        elif isinstance(e, CallStart):
            out.append(("start", e.index, e.name))
        elif isinstance(e, CallEnd):
            out.append(("end", e.index))
    return out


def run(parser: ToolCallParser, pieces: list[str]) -> list[Event]:
    events: list[Event] = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def byte_pieces(text: str, cut: int) -> list[str]:
    """The text's UTF-8 bytes split at `cut`, decoded as a stream decoder gives them."""
    data = text.encode()
    dec = codecs.getincrementaldecoder("utf-8")()
    return [dec.decode(data[:cut]), dec.decode(data[cut:], final=True)]


@pytest.mark.parametrize("rec", RECORDED, ids=[f"{r.parser}-{k}" for k, r in enumerate(RECORDED)])
def test_one_shot_parse_finds_the_calls_and_the_content(rec: Recorded) -> None:
    msg = ParsedMessage().add(run(PARSERS[rec.parser](), [rec.text]))
    assert msg.content == rec.content
    assert msg.cut_call == rec.cut
    assert [c.name for c in msg.calls] == [name for name, _ in rec.calls]
    for call, (_, args) in zip(msg.complete_calls, rec.calls):
        assert json.loads(call.arguments) == args
        assert call.id.startswith("call_")
    assert not any(m in msg.content for m in MARKUP)


@pytest.mark.parametrize("rec", RECORDED, ids=[f"{r.parser}-{k}" for k, r in enumerate(RECORDED)])
def test_any_split_of_the_stream_adds_up_to_the_one_shot_parse(rec: Recorded) -> None:
    whole = normalise(run(PARSERS[rec.parser](), [rec.text]))
    splits = [[rec.text[:i], rec.text[i:]] for i in range(len(rec.text) + 1)]
    splits += [byte_pieces(rec.text, i) for i in range(len(rec.text.encode()) + 1)]
    splits += [list(rec.text), [rec.text[i:i + 3] for i in range(0, len(rec.text), 3)]]
    for pieces in splits:
        events = run(PARSERS[rec.parser](), pieces)
        assert normalise(events) == whole, pieces
        shown = "".join(e.text for e in events if isinstance(e, Text))
        assert not any(m in shown for m in MARKUP), pieces


def test_no_markup_leaks_before_a_trigger_is_decided() -> None:
    """Text that may still be a trigger's start is held, and released when it is not."""
    p = PARSERS["hermes"]()
    assert p.feed("Hi <tool_") == [Text("Hi")]
    assert p.feed("cal") == []
    assert p.feed("x") == [Text(" <tool_calx")]
    assert p.feed(" <tool_call>\n{\"name\": \"get_time\", ") == []  # the gap before a call is not content
    events = p.feed('"arguments": {"tz": "U')
    assert [type(e) for e in events] == [CallStart, CallArgs] and events[0].name == "get_time"
    assert events[1].text == '{"tz": "U'
    assert p.feed('TC"}}\n</tool_call>') == [CallArgs(0, 'TC"}'), CallEnd(0)]


def test_every_parser_name_is_registered() -> None:
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


# ---- the grammars ------------------------------------------------------------------------------

TOOLS = [ToolSpec("get_weather", {"type": "object", "properties": {
             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}),
         ToolSpec("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})]
CALL = {"get_weather": {"city": "Paris", "unit": "celsius"}, "get_time": {"tz": "CET"}}
# each format's constrained writing of one call, and of two calls
WRITTEN = {
    "hermes": ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
               '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'),
    "llama3": ('{"name": "get_time", "parameters": {"tz": "CET"}}',
               '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "CET"}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]'),
    "pythonic": ('[get_time(tz="CET")]', '[get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]'),
}
WRITTEN["qwen25"] = WRITTEN["hermes"]
BAD = {  # an unknown function; an argument outside its enum
    "hermes": ('<tool_call>\n{"name": "rm_rf", "arguments": {}}',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"'),
    "llama3": ('{"name": "rm_rf", "parameters": {}}', '{"name": "get_weather", "parameters": {"city": "P", "unit": "k'),
    "mistral": ('[TOOL_CALLS] [{"name": "rm_rf"', '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P", '
                '"unit": "k'),
    "pythonic": ("[rm_rf(", '[get_weather(city="P", unit="k'),
}
BAD["qwen25"] = BAD["hermes"]
_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)


def accepts(fmt: dict[str, Any], text: str, whole: bool = True) -> bool:
    matcher = xgr.GrammarMatcher(_COMPILER.compile_structural_tag(json.dumps({"type": "structural_tag",
                                                                              "format": fmt})))
    return matcher.accept_string(text) and (matcher.is_completed() or not whole)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_forced_grammar_takes_the_formats_calls_and_refuses_others(name: str) -> None:
    parser = PARSERS[name]
    one, two = WRITTEN[name]
    assert accepts(parser.structural_tag(TOOLS, forced=True, parallel=False), one)
    assert not accepts(parser.structural_tag(TOOLS, forced=True, parallel=False), two)  # one call only
    assert accepts(parser.structural_tag(TOOLS, forced=True, parallel=True), two)
    assert not accepts(parser.structural_tag(TOOLS, forced=True, parallel=True), "Sure, here it is")
    assert not accepts(parser.structural_tag(TOOLS[1:], forced=True, parallel=True), two)  # a named function only
    for bad in BAD[name]:
        assert not accepts(parser.structural_tag(TOOLS, forced=True, parallel=True), bad, whole=False)
    # what the grammar lets through, the parser reads as the calls
    msg = ParsedMessage().add(run(parser(), [two]))
    assert [(c.name, json.loads(c.arguments)) for c in msg.complete_calls] == [
        ("get_weather", CALL["get_weather"]), ("get_time", CALL["get_time"])]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_auto_grammar_takes_text_and_constrains_a_call_once_triggered(name: str) -> None:
    parser = PARSERS[name]
    fmt = parser.structural_tag(TOOLS, forced=False, parallel=True)
    assert accepts(fmt, "Plain text, no call.")
    assert accepts(fmt, "Let me look. " + WRITTEN[name][0])
    unknown, outside_enum = BAD[name]
    assert not accepts(fmt, "Let me look. " + outside_enum, whole=False)
    # an unknown function is refused, or (pythonic: only the tools' names trigger) is text to the parser too
    if accepts(fmt, "Let me look. " + unknown + '")]', whole=False):
        msg = ParsedMessage().add(run(parser([t.name for t in TOOLS]), ["Let me look. " + unknown + ")]"]))
        assert not msg.calls and msg.content == "Let me look. " + unknown + ")]"


FRAGMENTS = ["<tool_call>", "</tool_call>", '{"name": "get_time", "arguments": ', '{"name"', "<|python_tag|>",
             "[TOOL_CALLS]", "get_time(", "{", "}", "[", "]", "(", ")", '"', "\\", ",", ";", ":", " ", "\n",
             "\t", "tz=", '"CET"', "1", "true", "text", "é", "<", "<tool", "[TOOL"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_random_texts_parse_the_same_in_any_pieces(name: str) -> None:
    """Seeded garbage built from every format's markup: the parser never
    fails, and random splits add up to the one-shot parse."""
    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30)))
        whole = normalise(run(PARSERS[name](), [text]))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert normalise(run(PARSERS[name](), pieces)) == whole, (text, pieces)
        assert normalise(run(PARSERS[name](), list(text))) == whole, text
