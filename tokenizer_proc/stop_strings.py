"""Stop strings and stop regexes, matched on the detokenized text as it streams.

A stop string can straddle two tokens (or two streamed chunks), so text that
could be the start of one is held back until the next text decides: either
the stop string completes (the text is cut just before it, or just after it
with `no_stop_trim`) or it cannot any more (the held text is released). A
stop regex (`stop_regex`, SGLang's) is held back the same way: from where a
partial match of it begins (the `regex` module's partial matching) to the
end. Text once released is never taken back, so a client never sees part of
a stop string or of a regex match.
"""

from __future__ import annotations

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


class StopStringMatcher:
    def __init__(self, stops: list[str], regexes: list[str] | None = None, keep: bool = False) -> None:
        self.stops = stops
        self.regexes = [(p, compile_stop_regex(p)) for p in regexes or []]
        self.keep = keep  # no_stop_trim: the matched text stays in the output
        self.pending = ""  # held back: a suffix that may begin a stop string or a regex match
        self.matched: str | None = None  # the stop string, or the regex's pattern

    def feed(self, delta: str) -> str:
        """Takes new text; returns the text now safe to show. After a match,
        `matched` is set and nothing more is returned."""
        if self.matched is not None:
            return ""
        buf = self.pending + delta
        hit = self._first_match(buf)
        if hit is not None:
            start, end, self.matched = hit
            self.pending = ""
            return buf[:end] if self.keep else buf[:start]
        hold = max(self._held_suffix_len(buf), self._regex_held_len(buf))
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the output nothing more can complete a stop string."""
        out, self.pending = self.pending, ""
        return out if self.matched is None else ""

    def _first_match(self, buf: str) -> tuple[int, int, str] | None:
        """(start, end, what matched) of the occurrence that ends first (so the
        answer does not depend on how the text was chunked); among those ending
        together, the longest."""
        best: tuple[int, int, str] | None = None  # (end, start, matched)
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0:
                key = (i + len(stop), i, stop)
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

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _regex_held_len(self, buf: str) -> int:
        """Length of the suffix from where a regex match could still begin (its
        first partial match: one that runs into the end of the text)."""
        longest = 0
        for _, rx in self.regexes:
            m = self._search(rx, buf, partial=True)
            if m is not None and m.partial:
                longest = max(longest, len(buf) - m.start())
        return longest

    @staticmethod
    def _search(rx: regex.Pattern, buf: str, partial: bool) -> regex.Match | None:
        try:
            return rx.search(buf, partial=partial, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {rx.pattern!r} took more than {REGEX_TIMEOUT_S} s "
                                   "to match the output") from None
