"""Scheduler-side memory bookkeeping: which KV pages and which table rows are free.

The model process holds the KV tensors and its own copy of `req_to_token`; the
scheduler decides which slots every token gets and keeps a mirror of the table
so it can free a request's slots without asking the model.
"""

from __future__ import annotations

import numpy as np

# The scheduler's slots, pages and table are numpy arrays, not torch tensors:
# the process never computes on them, and without torch it starts with ~1.8 s
# less CPU (torch's import), taken on 2 cores from the model process loading
# beside it; an operation on a few elements also costs an array a fraction of
# what it costs a tensor, every step.
Slots = np.ndarray  # int64 KV slot ids


def slots_taken(kv_len: int, n: int, page_size: int) -> int:
    """Slots of the pool that n more tokens take for a request holding kv_len:
    the room left in its last page first, then whole new pages."""
    return -(-(kv_len + n) // page_size) * page_size - -(-kv_len // page_size) * page_size


class PageAllocator:
    """Free list of KV pages; page p holds slots 1 + p*page_size .. (p+1)*page_size.
    Slot 0 is the dummy target for padding and belongs to no page.

    A request's tokens fill its pages in order, so its keys and values lie in
    runs of `page_size` consecutive slots: attention streams a run instead of
    fetching rows scattered over the pool (SGLang's --page-size, vLLM's block
    size). A stack of page ids in one preallocated array: alloc takes the top
    n, free pushes back, each a slice copy costing the pages moved.

    Freed pages are handed out again before pages never handed out (LIFO: the
    most recently freed first). The pool is allocated untouched (on a CPU its
    memory is committed only when a slot is first written), so the pages ever
    handed out are what the pool costs in memory: reusing the warm ones keeps
    that set as small as the load allows, and their lines in the CPU's caches.
    The never-handed-out pages are the bottom `untouched` entries of the stack
    (frees land above them), so telling the two apart is one counter."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        assert page_size >= 1
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.size = self.num_pages * page_size  # slots in whole pages; a partial last page is unused
        self.stack = np.arange(self.num_pages, dtype=np.int64)
        self.num_free = self.num_pages
        self.untouched = self.num_pages  # stack[:untouched]: pages never handed out

    def available(self) -> int:
        """Free slots (whole pages)."""
        return self.num_free * self.page_size

    def reusable_pages(self) -> int:
        """Free pages that were handed out before (their memory is resident)."""
        return self.num_free - self.untouched

    def touched_slots(self) -> int:
        """Slots of the pages ever handed out: the pool's resident part."""
        return (self.num_pages - self.untouched) * self.page_size

    def alloc_pages(self, n: int) -> Slots | None:
        """n page ids, or None if fewer are free: freed ones first, most recent first."""
        if n > self.num_free:
            return None
        self.num_free -= n
        self.untouched = min(self.untouched, self.num_free)
        return self.stack[self.num_free:self.num_free + n].copy()  # frees overwrite the stack

    def first_slots(self, pages: Slots) -> Slots:
        return pages * self.page_size + 1

    def free(self, slots: Slots) -> None:
        """Give back the pages of a run of a request's positions that starts on
        a page boundary: every page_size-th slot, from the first, opens a page
        (the run's last page may be partly used)."""
        starts = slots[::self.page_size].astype(np.int64) - 1
        assert bool(((starts % self.page_size) == 0).all()), "freed slots do not start pages"
        self.free_pages(starts // self.page_size)

    def free_pages(self, pages: Slots) -> None:
        k = pages.size
        if k:
            assert self.num_free + k <= self.num_pages, "more pages freed than the pool holds"
            self.stack[self.num_free:self.num_free + k] = pages
            self.num_free += k


class ReqToTokenPool:
    """Rows of the `req_to_token` table: row r, column p holds the KV slot of
    token p of the request resident in row r. Row 0 is never handed out."""

    def __init__(self, num_rows: int, context_len: int) -> None:
        self.num_rows = num_rows
        self.req_to_token = np.zeros((num_rows + 1, context_len), dtype=np.int32)
        self.free_rows: list[int] = list(range(1, num_rows + 1))

    def available(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)
