"""Stop strings and stop regexes, matched on the detokenized text as it streams.

A stop string can straddle two tokens (or two streamed chunks), so text that
could be the start of one is held back until the next text decides: either
the stop string completes (the text is cut just before it, or just after it
with `no_stop_trim`) or it cannot any more (the held text is released). A
stop regex (`stop_regex`, SGLang's) is held back the same way: from where a
partial match of it begins (the `regex` module's partial matching) to the
end, but never more than MAX_REGEX_HOLD_CHARS: a longer match is not found.
Text once released is never taken back, so a client never sees part of a
stop string or of a regex match.

Per token the work is the new text (each stop string's KMP automaton reads
it once) plus a regex search of the held-back text: it does not grow with the
output.
"""

from __future__ import annotations

import functools

import regex

REGEX_TIMEOUT_S = 0.1  # per search: a pathological pattern ends its request, not the server
MAX_REGEX_CHARS = 512


class StopRegexTimeout(RuntimeError):
    pass


def compile_stop_regex(pattern: str) -> regex.Pattern:
    """Raises ValueError with the reason when the pattern cannot be a stop regex."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"longer than {MAX_REGEX_CHARS} characters")
    try:
        rx = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"not a valid regular expression: {e}") from None
    if rx.fullmatch("", timeout=REGEX_TIMEOUT_S):
        raise ValueError("it matches the empty string, so it would stop at once")
    return rx


# A stop regex holds back at most this much text: a partial match that began
# further back is released, so a regex match is found only within this many
# characters (and every token's search stays this short).
MAX_REGEX_HOLD_CHARS = 1024


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
    `feed`, the work is the new text (per stop string) plus a regex search of
    the held-back text, never the whole output."""

    def __init__(self, stops: list[str], regexes: list[str] | None = None, keep: bool = False) -> None:
        self.stops = stops
        self.failures = [_failure(s) for s in stops]
        self.states = [0] * len(stops)  # per stop: the longest prefix of it that ends the text
        self.regexes = [(p, compile_stop_regex(p)) for p in regexes or []]
        self.keep = keep  # no_stop_trim: the matched text stays in the output
        self.pending = ""  # held back: a suffix that may begin a stop string or a regex match
        self.matched: str | None = None  # the stop string, or the regex's pattern
        self.scanned = 0  # characters examined, all feeds together (the tests' measure of work)

    def feed(self, delta: str) -> str:
        """Takes new text; returns the text now safe to show. After a match,
        `matched` is set and nothing more is returned."""
        if self.matched is not None:
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
        for pattern, rx in self.regexes:
            m = self._search(rx, buf, partial=False)
            if m is not None:
                key = (m.end(), m.start(), pattern)
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
        """Length of the suffix from where a regex match could still begin (its
        first partial match: one that runs into the end of the text), at most
        MAX_REGEX_HOLD_CHARS."""
        longest = 0
        for _, rx in self.regexes:
            m = self._search(rx, buf, partial=True)
            if m is not None and m.partial:
                longest = max(longest, len(buf) - m.start())
        return min(longest, MAX_REGEX_HOLD_CHARS)

    def _search(self, rx: regex.Pattern, buf: str, partial: bool) -> regex.Match | None:
        self.scanned += len(buf)
        try:
            return rx.search(buf, partial=partial, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {rx.pattern!r} took more than {REGEX_TIMEOUT_S} s "
                                   "to match the output") from None
