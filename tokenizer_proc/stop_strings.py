"""Stop strings, matched on the detokenized text as it streams.

A stop string can straddle two tokens (or two streamed chunks), so text that
could be the start of one is held back until the next text decides: either
the stop string completes (the text is cut just before it) or it cannot any
more (the held text is released). Text once released is never taken back, so
a client never sees part of a stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""  # held back: a suffix that may begin a stop string
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Takes new text; returns the text now safe to show. After a match,
        `matched` is set and nothing more is returned."""
        if self.matched is not None:
            return ""
        buf = self.pending + delta
        hit = self._first_match(buf)
        if hit is not None:
            start, self.matched = hit
            self.pending = ""
            return buf[:start]
        hold = self._held_suffix_len(buf)
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the output nothing more can complete a stop string."""
        out, self.pending = self.pending, ""
        return out if self.matched is None else ""

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """The occurrence that ends first (so the answer does not depend on how
        the text was chunked); among those ending together, the longest."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0:
                key = (i + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
