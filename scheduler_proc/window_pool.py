"""The sliding-window layers' KV pages: a second, smaller pool (SGLang's SWA
pool, vLLM's hybrid allocator; our own design).

A model with sliding-window layers (Gemma 2/3; Mistral and Phi-3 configs
with a window) keeps two pools. The full pool, whose slots CacheManager
hands out and `req_to_token` holds, stores the global layers' K/V of every
token; this pool stores the sliding layers' K/V, and a token holds a slot
here only while a query can still see it. Every full page handed out is
paired with a page of this pool (the same offsets inside both), and the
pair is undone early once the page's tokens fell behind the window of
every later query of their request: a request's sliding-layer KV is then
bounded by its window, not by its length. The model process keeps the same
pairing (ForwardBatch.window_pages) and reads and writes the sliding layers
through it.

A full page whose pair was undone may still be in use (a request's older
tokens, or the prefix cache's): the global layers need it, the sliding ones
no longer. The prefix cache hence reuses a prefix of n tokens only if the
window pages of its last window - 1 tokens are still held (CacheManager.match).
"""

from __future__ import annotations

import numpy as np

from scheduler_proc.memory import PageAllocator, Slots


class WindowPool:
    def __init__(self, full_pages: int, num_slots: int, page_size: int, window: int) -> None:
        """full_pages: the full pool's pages; num_slots: this pool's size;
        window: the largest sliding window of the model's layers (a query at
        position i sees keys i - window + 1 .. i)."""
        self.allocator = PageAllocator(num_slots, page_size)
        self.size = self.allocator.size
        self.page_size = page_size
        self.window = window
        self.page_of = np.full(full_pages, -1, dtype=np.int64)  # full page -> its window page
        self.pending: list[int] = []  # (full page, window page) pairs made since the last step was sent

    def available(self) -> int:
        """Free slots (whole pages)."""
        return self.allocator.available()

    def held_slots(self) -> int:
        """Slots of the window pages paired with a full page."""
        return int((self.page_of >= 0).sum()) * self.page_size

    def pair(self, full_pages: Slots) -> bool:
        """A window page for each of `full_pages` (just handed out); False,
        and nothing changes, if this pool has too few free."""
        pages = self.allocator.alloc_pages(full_pages.size)
        if pages is None:
            return False
        self.page_of[full_pages] = pages
        self.pending += np.stack([full_pages, pages], 1).reshape(-1).tolist()
        return True

    def release(self, full_slots: Slots) -> None:
        """Undo the pairs of the full pages holding `full_slots` (any slots;
        pages already unpaired are skipped)."""
        if not full_slots.size:
            return
        pages = np.unique((full_slots.astype(np.int64) - 1) // self.page_size)
        held = pages[self.page_of[pages] >= 0]
        if held.size:
            self.allocator.free_pages(self.page_of[held])
            self.page_of[held] = -1

    def held(self, full_slots: Slots) -> np.ndarray:
        """Per slot: whether its page still has its window page (bool)."""
        return self.page_of[(full_slots.astype(np.int64) - 1) // self.page_size] >= 0

    def take_pending(self) -> list[int]:
        """The pairs made since the last call, flattened (full page, window
        page, ...), for the model process's copy, in the order made."""
        pending, self.pending = self.pending, []
        return pending


def usable_prefix(held: np.ndarray, window: int, page_size: int) -> int:
    """The longest prefix length n' <= n = len(held) that a request can start
    from: the sliding layers of its first new token (position n') see keys
    n' - window + 1 .. n' - 1, so those must still be held. n' is n itself or
    a page boundary (held is constant inside a page)."""
    n = held.size
    absent = np.flatnonzero(~held)
    while absent.size and int(absent[-1]) >= n - window + 1:
        a = int(absent[-1])
        n = a - a % page_size  # no key of the shorter prefix lies in the missing page
        absent = absent[absent < n]
    return n
