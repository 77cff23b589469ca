"""ngram: draft tokens for speculative decoding (SGLang's NGRAM algorithm),
looked up by the last few tokens of a request rather than computed by a
draft model.

Two sources, both plain dicts of n-gram tuples. PromptLookup matches a
request against its own prompt and output (code and summaries repeat their
input). SuffixTable matches it against the outputs of recent requests
(SuffixDecoding's idea: agents and templated answers repeat across
requests). Neither needs torch or the model; a draft that turns out wrong
costs only its verification, so both are cheap guesses, not careful ones.
"""

from __future__ import annotations

from collections import OrderedDict


def _check_windows(min_window: int, max_window: int) -> None:
    if not 1 <= min_window <= max_window:
        raise ValueError(f"need 1 <= min_window <= max_window, got {min_window} and {max_window}")


class PromptLookup:
    """One request's drafts from its own tokens (prompt lookup): the longest
    suffix of its tokens (between min_window and max_window tokens long) that
    occurred earlier in them, and the tokens that followed its most recent
    earlier occurrence."""

    def __init__(self, min_window: int, max_window: int) -> None:
        _check_windows(min_window, max_window)
        self.min_window = min_window
        self.max_window = max_window
        # n-gram -> end (exclusive) of its latest occurrence that has a token
        # after it; the suffix itself has none, so a lookup never matches it
        self._index: dict[tuple[int, ...], int] = {}
        self._seen = 0  # len(tokens) at the last call: ends 1..seen-1 are indexed

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens (may be fewer, or none). `tokens` is the
        request's prompt + output so far; between calls it only grows at the
        end (the same list or an equal-prefix copy), so the index is built
        incrementally: each call costs O((new tokens + 1) * windows *
        max_window) (the n-gram tuples it builds), never a rescan of the
        whole sequence."""
        self._extend(tokens)
        if max_drafts <= 0:
            return []
        end = len(tokens)
        # longest window first; a window needs one earlier token to match
        for n in range(min(self.max_window, end - 1), self.min_window - 1, -1):
            e = self._index.get(tuple(tokens[end - n:end]))
            if e is not None:
                return tokens[e:e + max_drafts]
        return []

    def _extend(self, tokens: list[int]) -> None:
        if len(tokens) < self._seen:
            # a retracted request recomputed (or a caller bug): what was
            # indexed may no longer be its prefix, so start over
            self._index.clear()
            self._seen = 0
        # the ends that gained a following token since the last call; in
        # increasing order, so the latest occurrence overwrites earlier ones
        for e in range(max(self._seen, 1), len(tokens)):
            for n in range(self.min_window, min(self.max_window, e) + 1):
                self._index[tuple(tokens[e - n:e])] = e
        self._seen = len(tokens)


class SuffixTable:
    """Across requests (SuffixDecoding's idea): continuations seen in the
    outputs of recent requests, bounded in size (least recently added
    n-grams dropped first)."""

    def __init__(self, min_window: int, max_window: int, capacity: int, *,
                 max_continuation: int = 16) -> None:
        _check_windows(min_window, max_window)
        if capacity < 1 or max_continuation < 1:
            raise ValueError(f"capacity and max_continuation must be >= 1, got {capacity} and {max_continuation}")
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self.max_continuation = max_continuation
        # n-gram -> what followed its most recent occurrence; insertion order
        # is age, so the front is what eviction drops
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, tokens: list[int]) -> None:
        """A finished request's output tokens (the scheduler calls it once per request)."""
        for e in range(1, len(tokens)):
            # one tuple per end, shared by its windows' entries
            continuation = tuple(tokens[e:e + self.max_continuation])
            for n in range(self.min_window, min(self.max_window, e) + 1):
                key = tuple(tokens[e - n:e])
                self._table[key] = continuation
                self._table.move_to_end(key)  # re-added: young again
                # evict per insert, so one long output never overshoots the bound
                if len(self._table) > self.capacity:
                    self._table.popitem(last=False)

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that followed the longest suffix of
        `tokens` (min_window..max_window long) in a recent output, or []. A
        lookup does not refresh an entry's age: only add does."""
        if max_drafts <= 0:
            return []
        end = len(tokens)
        # the whole of `tokens` may be the key: the table holds other requests'
        # tokens, so there is no self-match to avoid
        for n in range(min(self.max_window, end), self.min_window - 1, -1):
            continuation = self._table.get(tuple(tokens[end - n:end]))
            if continuation is not None:
                return list(continuation[:max_drafts])
        return []

    def __len__(self) -> int:
        """Entries held (n-gram keys), never more than capacity."""
        return len(self._table)
