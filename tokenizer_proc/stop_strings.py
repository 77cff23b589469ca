"""Stop strings and stop regexes, matched on the detokenized text as it streams.

A stop string can straddle two tokens (or two streamed chunks), so text that
could be the start of one is held back until the next text decides: either
the stop string completes (the text is cut just before it, or just after it
with `no_stop_trim`) or it cannot any more (the held text is released). A
stop regex (`stop_regex`, SGLang's) is held back the same way: from where a
partial match of it begins to the end, but never more than
MAX_REGEX_HOLD_CHARS: a longer match is not found. Text once released is
never taken back, so a client never sees part of a stop string or of a regex
match.

Stop regexes come from clients, so they run on RE2, whose searches take time
linear in the text whatever the pattern (a backtracking engine can take
exponential time: `(?:[\\s\\S][\\s\\S]?)*[\\x00\\x01]`). RE2 has no partial
matching, so each pattern is compiled twice from Python's parse of it (the
syntax SGLang's clients write): the pattern itself, and the regex of its
prefixes, anchored at the end of the text; the leftmost match of the second is
where the held-back text begins. What RE2 cannot run in linear time
(backreferences, lookaround, atomic groups, possessive repeats) is refused
when the request is validated. `\\d`, `\\w` and `\\s` are Unicode, as in
Python. Where RE2 differs from Python: `\\b` is ASCII, and so are `\\W` and
`\\S` inside a negated class beside other items (`[^\\W_]`); `$` without
MULTILINE matches only at the end of the text; where a repeated group can
match the empty string, a match may end elsewhere (it begins at the same place).

Per token the work is the new text (each stop string's KMP automaton reads
it once) plus two searches of the held-back text per regex: it does not grow
with the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import re2

try:  # the standard library's parser of Python's regex syntax
    from re import _constants as sre
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_REGEX_CHARS = 512
# A stop regex holds back at most this much text: a partial match that began
# further back is released, so a regex match is found only within this many
# characters (and every token's search stays this short).
MAX_REGEX_HOLD_CHARS = 1024
# Instructions in each RE2 program of a pattern: a search costs at most the
# text's length times this, even where RE2 falls back from its DFA.
MAX_PROGRAM_SIZE = 5000
_RE2_MEMORY = 2 << 20  # bytes per program, its DFA cache included


def _re2_options() -> Any:
    options = re2.Options()
    options.max_mem = _RE2_MEMORY
    options.log_errors = False  # a client's bad pattern is its 400, not our log
    return options


_OPTIONS = _re2_options()


class UnsupportedRegex(ValueError):
    pass


@dataclass(frozen=True)
class StopRegex:
    pattern: str  # as the client wrote it
    match: Any  # RE2: the pattern
    prefix: Any  # RE2: any prefix of a match, ending at the end of the text


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    """Raises ValueError with the reason when the pattern cannot be a stop
    regex. Cached: the n samples of a request, and its validation, compile once."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"longer than {MAX_REGEX_CHARS} characters")
    try:
        parsed = sre_parse.parse(pattern)
    except sre.error as e:
        raise ValueError(f"not a valid regular expression: {e}") from None
    except RecursionError:  # the parser recurses once per nested group
        raise ValueError("nested too deeply") from None
    try:
        match_text, prefix_text = _full(parsed), _prefix(parsed) + r"\z"
    except RecursionError:
        raise ValueError("nested too deeply") from None
    flags = _group_flags(parsed.state.flags, 0)
    if flags:
        match_text, prefix_text = f"(?{flags}:{match_text})", f"(?{flags}:{prefix_text})"
    match, prefix = _compile(match_text), _compile(prefix_text)
    if match.fullmatch("") is not None:
        raise ValueError("it matches the empty string, so it would stop at once")
    return StopRegex(pattern, match, prefix)


def _compile(text: str) -> Any:
    try:
        rx = re2.compile(text, _OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"RE2 cannot compile it: {reason}") from None
    program = rx._regexp
    if max(program.ProgramSize(), program.ReverseProgramSize()) > MAX_PROGRAM_SIZE:
        raise ValueError(f"too complex: more than {MAX_PROGRAM_SIZE} RE2 instructions")
    return rx


# ---- Python's parse of a pattern, written out in RE2's syntax ------------------------------
# Every group is written non-capturing: only the span of the whole match is used.

_REFUSED = {getattr(sre, name): what for name, what in (
    ("GROUPREF", "backreferences"), ("GROUPREF_EXISTS", "conditional groups"),
    ("ASSERT", "lookahead and lookbehind"), ("ASSERT_NOT", "lookahead and lookbehind"),
    ("ATOMIC_GROUP", "atomic groups"), ("POSSESSIVE_REPEAT", "possessive repeats"),
) if hasattr(sre, name)}
# Python's \d, \w and \s are Unicode (str.isdecimal, isalnum or "_", isspace);
# RE2's are ASCII, so they are written out as Unicode classes (the bodies of
# a [...]). \W and \S are the complements of theirs.
_SPACE = r"\t-\r\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
_CATEGORY = {sre.CATEGORY_DIGIT: r"\p{Nd}", sre.CATEGORY_NOT_DIGIT: r"\P{Nd}", sre.CATEGORY_WORD: r"\p{L}\p{N}_",
             sre.CATEGORY_SPACE: _SPACE}
_COMPLEMENTED = {sre.CATEGORY_NOT_WORD: (_CATEGORY[sre.CATEGORY_WORD], r"\W"),
                 sre.CATEGORY_NOT_SPACE: (_SPACE, r"\S")}
_AT = {sre.AT_BEGINNING: "^", sre.AT_BEGINNING_STRING: r"\A", sre.AT_END: "$", sre.AT_END_STRING: r"\z",
       sre.AT_BOUNDARY: r"\b", sre.AT_NON_BOUNDARY: r"\B"}
_FLAG_LETTERS = ((sre.SRE_FLAG_IGNORECASE, "i"), (sre.SRE_FLAG_MULTILINE, "m"), (sre.SRE_FLAG_DOTALL, "s"))
_SINGLE_CHAR = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN)
Node = tuple[Any, Any]  # (opcode, argument), as sre_parse makes them


def _letters(flags: int) -> str:
    return "".join(letter for flag, letter in _FLAG_LETTERS if flags & flag)


def _group_flags(add: int, delete: int) -> str:
    off = _letters(delete)
    return _letters(add) + (f"-{off}" if off else "")


def _char(code: int) -> str:
    c = chr(code)
    return c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{{{code:x}}}"


def _class(items: list[Node]) -> str:
    negate, bodies, complements = False, [], []
    for op, av in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            bodies.append(_char(av))
        elif op is sre.RANGE:
            bodies.append(f"{_char(av[0])}-{_char(av[1])}")
        elif op is sre.CATEGORY and av in _CATEGORY:
            bodies.append(_CATEGORY[av])
        elif op is sre.CATEGORY and av in _COMPLEMENTED:
            complements.append(_COMPLEMENTED[av])
        else:
            raise UnsupportedRegex(f"RE2 cannot take {op} in a character class")
    body = "".join(bodies)
    if not complements:
        return f"[{'^' if negate else ''}{body}]"
    if not negate:  # a union: what the class lists, or what a complement does
        return "(?:" + "|".join(([f"[{body}]"] if body else []) + [f"[^{c}]" for c, _ in complements]) + ")"
    if len(complements) == 1 and not body:
        return f"[{complements[0][0]}]"  # [^\W] is \w
    # An intersection ([^\W_]: word characters but "_"), which RE2 cannot write
    # with Unicode classes: RE2's own (ASCII) \W and \S stand in.
    return f"[^{body}{''.join(perl for _, perl in complements)}]"


def _count(low: int, high: int) -> str:
    if high == sre.MAXREPEAT:
        return "*" if low == 0 else "+" if low == 1 else f"{{{low},}}"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _full(items: list[Node]) -> str:
    return "".join(_full_node(op, av) for op, av in items)


def _full_node(op: Any, av: Any) -> str:
    if op is sre.LITERAL:
        return _char(av)
    if op is sre.NOT_LITERAL:
        return f"[^{_char(av)}]"
    if op is sre.ANY:
        return "."  # whether it takes a newline is the flags' (DOTALL), as in Python
    if op is sre.IN:
        return _class(av)
    if op is sre.BRANCH:
        return "(?:" + "|".join(_full(alt) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        _, add, delete, body = av
        return _group(add, delete, _full(body))
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        low, high, body = av
        return f"(?:{_full(body)}){_count(low, high)}" + ("?" if op is sre.MIN_REPEAT else "")
    if op is sre.AT and av in _AT:
        return _AT[av]
    raise _unsupported(op)


def _unsupported(op: Any) -> UnsupportedRegex:
    what = _REFUSED.get(op, str(op))
    return UnsupportedRegex(f"{what} cannot be matched in linear time (stop_regex runs on RE2)")


def _group(add: int, delete: int, body: str) -> str:
    flags = _group_flags(add, delete)
    return f"(?{flags}:{body})" if flags else f"(?:{body})"


def _prefix(items: list[Node]) -> str:
    """The regex of every prefix of what `items` match. For a sequence,
    P(x1 x2 ... xn) = P(x1) | x1 P(x2 ... xn), nested from the right so that its
    size stays linear in the sequence's."""
    acc: str | None = None
    for op, av in reversed(items):
        head = _prefix_node(op, av)
        acc = head if acc is None else f"(?:{head}|{_full_node(op, av)}{acc})"
    return acc or ""


def _prefix_node(op: Any, av: Any) -> str:
    if op in _SINGLE_CHAR:
        return f"(?:{_full_node(op, av)})?"
    if op is sre.BRANCH:
        return "(?:" + "|".join(_prefix(alt) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        _, add, delete, body = av
        return _group(add, delete, _prefix(body))
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        # a prefix of x{low,high} is some whole x's (fewer than high) then a prefix of one more
        low, high, body = av
        if high == 0:
            return ""
        whole = "" if high == 1 else f"(?:{_full(body)})" + ("*" if high == sre.MAXREPEAT else f"{{0,{high - 1}}}")
        return f"{whole}(?:{_prefix(body)})"
    if op is sre.AT and av in _AT:
        return ""  # whether it holds may depend on text not yet seen
    raise _unsupported(op)


# ---- The matcher ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's failure function: f[i] is the length of the longest proper prefix
    of stop[:i + 1] that is also a suffix of it."""
    f = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = f[k - 1]
        if stop[i] == stop[k]:
            k += 1
        f[i] = k
    return tuple(f)


class StopStringMatcher:
    """Each stop string is followed by a KMP automaton over the text: per
    `feed`, the work is the new text (per stop string) plus two RE2 searches
    of the held-back text per regex, never the whole output."""

    def __init__(self, stops: list[str], regexes: list[str] | None = None, keep: bool = False) -> None:
        self.stops = stops
        self.failures = [_failure(s) for s in stops]
        self.states = [0] * len(stops)  # per stop: the longest prefix of it that ends the text
        self.regexes = [compile_stop_regex(p) for p in regexes or []]
        self.keep = keep  # no_stop_trim: the matched text stays in the output
        self.pending = ""  # held back: a suffix that may begin a stop string or a regex match
        self.matched: str | None = None  # the stop string, or the regex's pattern
        self.scanned = 0  # characters examined, all feeds together (the tests' measure of work)

    def feed(self, delta: str) -> str:
        """Takes new text; returns the text now safe to show. After a match,
        `matched` is set and nothing more is returned."""
        if self.matched is not None or not delta:
            return ""
        buf = self.pending + delta
        hit = self._first_match(buf, len(self.pending))
        if hit is not None:
            start, end, self.matched = hit
            self.pending = ""
            return buf[:end] if self.keep else buf[:start]
        hold = max(max(self.states, default=0), self._regex_held_len(buf))
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the output nothing more can complete a stop string."""
        out, self.pending = self.pending, ""
        return out if self.matched is None else ""

    def _first_match(self, buf: str, new_from: int) -> tuple[int, int, str] | None:
        """(start, end, what matched) of the occurrence that ends first (so the
        answer does not depend on how the text was chunked); among those ending
        together, the longest. Only buf[new_from:] is new text."""
        best: tuple[int, int, str] | None = None  # (end, start, matched)
        for k, stop in enumerate(self.stops):
            end = self._advance(k, buf, new_from)
            if end >= 0:
                key = (end, end - len(stop), stop)
                best = key if best is None or key < best else best
        for rx in self.regexes:
            m = self._search(rx.match.search, buf)
            if m is not None:
                key = (m.end(), m.start(), rx.pattern)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, start, matched = best
        return start, end, matched

    def _advance(self, k: int, buf: str, new_from: int) -> int:
        """Runs stop k's automaton over the new text; returns where (in buf) its
        first occurrence ends, or -1. Amortized O(1) per character."""
        stop, fail, j = self.stops[k], self.failures[k], self.states[k]
        self.scanned += len(buf) - new_from
        for i in range(new_from, len(buf)):
            c = buf[i]
            while j and stop[j] != c:
                j = fail[j - 1]
            if stop[j] == c:
                j += 1
                if j == len(stop):
                    self.states[k] = j
                    return i + 1
        self.states[k] = j
        return -1

    def _regex_held_len(self, buf: str) -> int:
        """Length of the suffix from where a regex match could still begin (the
        leftmost start of a prefix of a match that runs to the end of the text),
        at most MAX_REGEX_HOLD_CHARS."""
        longest = 0
        for rx in self.regexes:
            m = self._search(rx.prefix.search, buf)
            if m is not None:  # always, but for a pattern whose prefixes need a context
                longest = max(longest, len(buf) - m.start())
        return min(longest, MAX_REGEX_HOLD_CHARS)

    def _search(self, search: Callable[[str], Any], buf: str) -> Any:
        self.scanned += len(buf)
        return search(buf)
