"""CacheManager: the one owner of KV state. Every slot and every table row is
handed out, shared, taken back and evicted here, and nowhere else.

Slots come in pages of `page_size` consecutive slots (the allocator's unit;
1 is a slot per token). A request fills its own pages in order, so a page
belongs to one owner: a request, or the tree once whole pages of a request's
tokens go in. A request's own part of its row starts on a page boundary and
its last page may be partly used; counts below are in slots of whole pages.

Who owns a KV slot (slot 0 is the padding dummy and belongs to no one):

    free list ──alloc──► a running request's own tail ──finish: insert──► tree
        ▲               (positions cached_prefix_len..kv_len              │
        │                of its req_to_token row)                         │
        └──────── free: retraction, abort, duplicates ◄───────────────────┤
        └──────── evict: least recently used unlocked leaves ◄────────────┘

    tree slots are protected while some request's matched path holds a lock
    on them (positions 0..cached_prefix_len of its row), evictable otherwise.

    Invariant: free + evictable + protected + Σ requests' own pages = pool size.

A request's row of `req_to_token` maps its positions to slots: the first
`cached_prefix_len` are the tree's (locked by `req.last_node`), the rest its
own. The model process's copy of the table follows what the batches carry: new
tokens' slots, and the rows this class rewrote (`req.table_sync_len`, sent as
ForwardBatch.table_rows with the request's next step), so a request can start
from KV that another request computed.

A model with sliding-window layers has a second pool for them
(scheduler_proc/window_pool.py): each page above is paired with one of its
pages when handed out, and unpaired when freed, or earlier, once its
tokens fell behind the window of their request's next token
(`_slide_window`); a prefix match is cut to what the sliding layers can
start from (`match`). That pool's accounts: free + paired = its size.

With `--disable-radix-cache` (and under static or dynamic batching) there is
no tree: nothing is matched or inserted, and a request's slots go back to the
free list when it ends.

This class is also the one writer of a request's lengths, so that they cannot
disagree with the table and the accounts above: `admit` sets `kv_len` and
`cached_prefix_len` to the matched prefix, `alloc_extend` and `alloc_decode`
advance `kv_len` over the slots they hand out (when a step is prepared, not
when its result is read: with overlap, a release before then frees those
slots too), `cache_unfinished` advances `cached_prefix_len`, and `release`
resets both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_proc.memory import PageAllocator, ReqToTokenPool, Slots, slots_taken
from scheduler_proc.radix_cache import PrefixMatch, RadixCache, TreeNode
from scheduler_proc.req import Req
from scheduler_proc.window_pool import WindowPool, usable_prefix


@dataclass(slots=True)
class KVCopy:
    """Rows a request took from the tree as a copy (its match ended inside a
    page): the tree's slots `src`, held by `node`'s lock until the copy goes
    out with the request's first extend, into `dst`, its own first page."""

    node: TreeNode
    src: Slots
    dst: Slots


class CacheManager:
    def __init__(self, pool_size: int, num_rows: int, context_len: int, use_tree: bool,
                 page_size: int = 1, max_idle_cached: int | None = None,
                 window: tuple[int, int] | None = None) -> None:
        """window: (the model's largest sliding window, the window pool's
        slots) for a model with sliding-window layers; None: one pool."""
        self.allocator = PageAllocator(pool_size, page_size)
        self.window_pool = WindowPool(self.allocator.num_pages, window[1], page_size, window[0]) \
            if window is not None else None
        # evictable tree slots kept before a page is taken from the pool's
        # never-touched memory (None: no bound; see _take_pages)
        self.max_idle_cached = max_idle_cached
        self.page_size = page_size
        self.size = self.allocator.size
        self.req_to_token_pool = ReqToTokenPool(num_rows, context_len)
        self.tree = RadixCache(self._free, page_size) if use_tree else None
        self.resident: dict[int, Req] = {}  # table row -> the request holding it
        self.pending_copies: dict[int, KVCopy] = {}  # table row -> rows to copy with its first extend
        # hit rate: prompt tokens offered to match on admission vs. taken from the tree
        self.matched_tokens = 0
        self.offered_tokens = 0

    @property
    def table(self) -> np.ndarray:
        return self.req_to_token_pool.req_to_token

    # ---- capacity ------------------------------------------------------------------------

    def available(self) -> int:
        """Slots a request can get now: the free list plus what eviction frees."""
        return self.allocator.available() + (self.tree.evictable_size if self.tree else 0)

    def window_available(self) -> int | None:
        """Window-pool slots an allocation can have (None: no window pool):
        the free ones, those of cached prefixes no request locks (evicted
        when needed), and those of cached tokens behind their one locker's
        window (given back when needed)."""
        pool = self.window_pool
        if pool is None:
            return None
        if pool.available() == pool.size or self.tree is None:
            return pool.available()
        P = self.page_size
        unlocked = sum(int(pool.held(n.value[::P]).sum()) for n in self.tree.unlocked_nodes()) * P
        return pool.available() + unlocked + self._release_passed_tree_windows(count_only=True)

    def can_decode(self, reqs: list[Req]) -> bool:
        """Whether both pools have the pages a decode step of `reqs` opens."""
        need = self.decode_slots(reqs)
        if self.available() < need:
            return False
        self._slide_windows(reqs)  # what the step would give back first
        return self.window_pool is None or self._window_room(need)

    def token_usage(self) -> float:
        """Share of the pool held by requests (cached but evictable slots are free)."""
        return 1.0 - self.available() / self.size

    def pages_for(self, tokens: int) -> int:
        """Slots that `tokens` tokens starting on a page boundary take: whole pages."""
        return slots_taken(0, tokens, self.page_size)

    def decode_slots(self, reqs: list[Req]) -> int:
        """Slots a decode step of `reqs` takes: a new page for each row whose
        last page is full."""
        return sum(self.page_size for r in reqs if r.kv_len % self.page_size == 0)

    def _window_room(self, slots: int) -> bool:
        """Whether the window pool has `slots` free, making room if not: first
        cached prefixes no request locks (least recently used first, both
        pools' pages, as the full pool evicts), then the window pages of
        cached tokens that only a request past them still locks."""
        pool = self.window_pool
        assert pool is not None
        if pool.available() < slots and self.tree is not None:
            self.tree.evict(0, until=lambda: pool.available() >= slots)
            if pool.available() < slots:
                self._release_passed_tree_windows()
        return pool.available() >= slots

    def _release_passed_tree_windows(self, count_only: bool = False) -> int:
        """Unpair the window pages of the prefix cache's tokens that the one
        request locking them has left behind its window. Only under window
        pressure, since a request arriving later can start from them while
        they are held (SGLang's SWA tree frees them the same lazy way).
        Returns the slots freed (count_only: that would be, freeing none)."""
        pool = self.window_pool
        assert pool is not None
        freed = 0
        for r in self.resident.values():
            passed = (r.kv_len - pool.window + 1) // self.page_size * self.page_size
            end, node = r.cached_prefix_len, r.last_node  # the path root..last_node holds 0..end
            while node is not None and not node.is_root:
                start = end - len(node)
                if node.lock_ref == 1 and start < passed:
                    slots = node.value[:min(end, passed) - start]
                    freed += int(pool.held(slots[::self.page_size]).sum()) * self.page_size
                    if not count_only:
                        pool.release(slots)
                end, node = start, node.parent
        return freed

    def _free(self, slots: Slots) -> None:
        """Free a run of a request's positions (its pages), and their window pages."""
        if self.window_pool is not None:
            self.window_pool.release(slots)
        self.allocator.free(slots)

    def _take_pages(self, n: int) -> Slots | None:
        """n pages (each with its window page, with a window pool), evicting
        unlocked cache if a free list is short; None if even that is not
        enough (nothing is allocated then; with a window pool, what was
        evicted for it stays evicted).

        Pages freed before come first (the allocator's order). Past them, a
        page the pool never handed out costs memory the process has not yet
        committed, so while the tree keeps more than `max_idle_cached` slots
        that no request uses, its least recently used ones are evicted and
        reused first: the resident pool follows the load (plus that much
        cache) instead of growing to the whole pool as the tree fills it."""
        if self.tree is not None and self.max_idle_cached is not None:
            fresh = n - self.allocator.reusable_pages()
            over = self.tree.evictable_size - self.max_idle_cached
            if fresh > 0 and over > 0:
                self.tree.evict(min(fresh * self.page_size, over))
        short = n * self.page_size - self.allocator.available()
        if short > 0:
            if self.tree is None or self.tree.evictable_size < short:
                return None
            self.tree.evict(short)
        if self.window_pool is not None and not self._window_room(n * self.page_size):
            return None
        pages = self.allocator.alloc_pages(n)
        if pages is not None and self.window_pool is not None:
            assert self.window_pool.pair(pages), "window pool short after making room"
        return pages

    def can_alloc(self, reqs: list[Req], lens: list[int]) -> bool:
        """Whether both pools have the pages that lens[i] more tokens of each
        request open (a verify step's rows)."""
        need = sum(slots_taken(r.kv_len, n, self.page_size) for r, n in zip(reqs, lens))
        if self.available() < need:
            return False
        self._slide_windows(reqs)
        return self.window_pool is None or self._window_room(need)

    def alloc_extend(self, reqs: list[Req], extend_lens: list[int]) -> Slots | None:
        """Slots for the next extend_lens[i] prompt tokens of reqs[i] (alloc_tokens),
        and the count of prompt tokens the prefix cache served."""
        prefix_lens = [r.kv_len for r in reqs]
        locs = self.alloc_tokens(reqs, extend_lens)
        if locs is not None:
            for r, p, n in zip(reqs, prefix_lens, extend_lens):
                # prompt tokens served by the cache rather than computed: what was
                # matched beyond what this request computed itself (earlier chunks)
                r.cache_hit_tokens += max(0, p - r.already_computed)
                r.already_computed = max(r.already_computed, p + n)
        return locs

    def alloc_tokens(self, reqs: list[Req], extend_lens: list[int]) -> Slots | None:
        """Slots for extend_lens[i] more tokens of reqs[i] after its kv_len,
        written into its table row (the rest of its last page, then new pages),
        and its kv_len advanced past them. Returns the slots concatenated
        (int64), or None if the pool cannot hold them (nothing changes then)."""
        P = self.page_size
        self._slide_windows(reqs)
        prefix_lens = [r.kv_len for r in reqs]
        fills = [min(n, -p % P) for p, n in zip(prefix_lens, extend_lens)]
        counts = [-(-(n - f) // P) for n, f in zip(extend_lens, fills)]
        pages = self._take_pages(sum(counts))
        if pages is None:
            return None
        runs = (self.allocator.first_slots(pages).reshape(-1, 1) + np.arange(P)).reshape(-1, P)
        parts: list[Slots] = []
        used = 0
        for r, p, n, f, k in zip(reqs, prefix_lens, extend_lens, fills, counts):
            row = r.req_pool_idx
            if f:  # the request's own last page (a chunk or a decode left it partly used)
                start = int(self.table[row, p - 1]) + 1
                parts.append(np.arange(start, start + f, dtype=np.int64))
            parts.append(runs[used:used + k].reshape(-1)[:n - f])
            used += k
            self.table[row, p:p + n] = np.concatenate(parts[-2:] if f else parts[-1:])
            r.kv_len = p + n
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def alloc_decode(self, reqs: list[Req]) -> Slots | None:
        """A slot for one more token of each request at position kv_len,
        written into its table row (the next slot of its last page, or a new
        page's first), and its kv_len advanced by one. None if the pool cannot
        hold them (nothing changes then)."""
        self._slide_windows(reqs)
        P = self.page_size
        positions = [r.kv_len for r in reqs]
        opens = sum(1 for p in positions if p % P == 0)  # tokens that start a page
        firsts: list[int] = []
        if opens:
            pages = self._take_pages(opens)
            if pages is None:
                return None
            firsts = self.allocator.first_slots(pages).tolist()
        rows, cols = np.array([r.req_pool_idx for r in reqs]), np.array(positions)
        # the others take the slot after their last one. Lists, not masked array ops:
        # this runs every decode step (as masked torch ops it cost ~0.3 ms of the
        # scheduler's ~1.3 ms at one row, time the model's threads lose on 2 cores)
        last = self.table[rows, cols - 1].tolist() if opens < len(reqs) else positions
        new = iter(firsts)
        locs = np.array([next(new) if p % P == 0 else s + 1 for p, s in zip(positions, last)], dtype=np.int64)
        self.table[rows, cols] = locs
        for r in reqs:
            r.kv_len += 1
        return locs

    def trim(self, req: Req, kv_len: int) -> None:
        """A verify step's rejected drafts: `req` holds KV for its first kv_len
        tokens again, and the pages past the one holding its last go back
        (the slots after it in that page stay its own, to be written next)."""
        assert req.cached_prefix_len <= kv_len <= req.kv_len, "trim past the request's own tokens"
        end = self.pages_for(kv_len)
        if req.kv_len > end:
            self._free(self.table[req.req_pool_idx, end:req.kv_len].astype(np.int64))
        req.kv_len = kv_len

    def _slide_windows(self, reqs: list[Req]) -> None:
        """Unpair the window pages of each request's own tokens that no query
        of its can see any more: its next token (position kv_len) sees
        kv_len - window + 1 on. A step in flight may still read them: a step
        that reuses the pages runs after it (the model runs steps in order).
        The prefix cache's pages wait for window pressure
        (_release_passed_tree_windows): a later request may start from them."""
        pool = self.window_pool
        if pool is None:
            return
        P = self.page_size
        for r in reqs:
            upto = (r.kv_len - pool.window + 1) // P * P
            if upto <= r.window_from:
                continue
            row = self.table[r.req_pool_idx]
            own_from = max(r.window_from, r.cached_prefix_len)
            if upto > own_from:
                pool.release(row[own_from:upto])
            r.window_from = upto

    def take_window_pages(self) -> list[int]:
        """The page pairs made since the last step was built, for the model's
        copy of the pairing (ForwardBatch.window_pages)."""
        return self.window_pool.take_pending() if self.window_pool is not None else []

    # ---- admission -----------------------------------------------------------------------

    def match(self, req: Req) -> PrefixMatch | None:
        """The cached prefix `req` could start from: at most all but its last
        token, which must be computed for its logits, and no further than its
        first prompt position whose logprob it still wants (Req.prefix_limit,
        SGLang's cap at logprob_start_len). None without a tree."""
        if self.tree is None:
            return None
        key = req.fill_ids[:req.prefix_limit]
        match = self.tree.match_prefix(key, req.cache_salt)
        if self.window_pool is not None and match.length:
            # the sliding layers of its first new token need the last window - 1 tokens' K/V
            n = usable_prefix(self.window_pool.held(np.concatenate([match.slots, match.copy_slots])),
                              self.window_pool.window, self.page_size)
            if n < match.length:
                match = self.tree.match_prefix(key[:n], req.cache_salt)
        return match

    def match_len(self, req: Req) -> int:
        """How many leading tokens of `req` the cache could serve now (for the
        lpm policy)."""
        match = self.match(req)
        return match.length if match is not None else 0

    def newly_protected(self, match: PrefixMatch | None) -> int:
        """Evictable slots that admitting with `match` would lock (they stop
        counting as available): its path, and the node it copies rows from
        until the copy is sent."""
        if self.tree is None or match is None:
            return 0
        return self.tree.evictable_on_path(match.copy_node or match.node)

    def admit(self, req: Req, match: PrefixMatch | None) -> None:
        """Give `req` a table row holding its matched prefix, locked in the tree.
        The caller checked that a row is free (the running-request budget) and
        budgeted the slots (PrefillAdder.fit).

        A match that ends inside a page (PrefixMatch.copy_slots) gives `req`
        a page of its own now, whose first rows the model copies from the
        tree's before the request's first extend computes the rest: its
        kv_len counts them, its own pages start at cached_prefix_len as
        always. The source node stays locked until that extend is prepared
        (take_kv_copies); nothing can overwrite it before the copy runs, as
        the model runs a step's copies before anything the step writes, and
        steps in order."""
        row = self.req_to_token_pool.alloc()
        assert row is not None, "admitted without a free req_to_token row"
        req.req_pool_idx = row
        self.resident[row] = req
        n = k = 0
        if match is not None:
            assert self.tree is not None
            n = match.slots.size
            self.tree.lock(match.node)
            req.last_node = match.node
            self.table[row, :n] = match.slots
            req.table_sync_len = n
            if match.copy_node is not None:
                self.tree.lock(match.copy_node)  # before taking the page: eviction must not take the source
                page = self._take_pages(1)
                if page is None:  # the budget counted the page; stay safe if it is not there
                    self.tree.unlock(match.copy_node)
                else:
                    k = match.copy_slots.size
                    dst = self.allocator.first_slots(page) + np.arange(k)
                    self.table[row, n:n + k] = dst
                    self.pending_copies[row] = KVCopy(match.copy_node, match.copy_slots, dst)
                    req.table_sync_len = n + k
            self.offered_tokens += req.num_tokens - 1
            self.matched_tokens += n + k
        req.cached_prefix_len = n
        req.kv_len = n + k

    def take_kv_copies(self, reqs: list[Req]) -> tuple[list[int], list[int]]:
        """The copies the rows of a step's extend are owed (source slots,
        destination slots), now going out with it: their sources are
        unlocked, since anything written there later runs after them."""
        src: list[int] = []
        dst: list[int] = []
        for r in reqs:
            copy = self.pending_copies.pop(r.req_pool_idx, None)
            if copy is not None:
                assert self.tree is not None
                self.tree.unlock(copy.node)
                src += copy.src.tolist()
                dst += copy.dst.tolist()
        return src, dst

    # ---- while running -------------------------------------------------------------------

    def cache_unfinished(self, req: Req, n: int) -> None:
        """Put a running request's first n tokens (their KV computed, or being
        computed by a step already sent) in the tree, so that requests coming
        later share them, and move its lock there: each prefill (or chunk) as
        it is sent. Tokens another request put there first were computed
        twice: this request's copies are freed and its row points at the
        tree's, here and, with its next step, in the model process."""
        n -= n % self.page_size  # the tree takes whole pages; the last partial one stays the request's
        if self.tree is None or not req.req_pool_idx or n <= req.cached_prefix_len:
            return
        row = self.table[req.req_pool_idx]
        had = self._insert_own(req, req.fill_ids[:n], row[:n].astype(np.int64))
        match = self.tree.match_prefix(req.fill_ids[:n], req.cache_salt)
        assert match.length == n, "an inserted key must match in full"
        if had > req.cached_prefix_len:
            # its duplicates were freed: point the row at the tree's copies, here
            # and (with the request's next step) in the model process
            row[:n] = match.slots
            req.table_sync_len = max(req.table_sync_len, had)
        self.tree.lock(match.node)
        self._unlock(req)
        req.last_node = match.node
        req.cached_prefix_len = n

    def _insert_own(self, req: Req, key: list[int], slots: Slots) -> int:
        """Insert `key`; the request's own slots for tokens the tree already had
        (put there by another request meanwhile) are duplicates: free them.
        Returns how many leading tokens the tree had."""
        assert self.tree is not None
        had = self.tree.insert(key, slots, req.cache_salt)
        if had > req.cached_prefix_len:
            self._free(slots[req.cached_prefix_len:had])
        return had

    # ---- the end of a residency ----------------------------------------------------------

    def release(self, req: Req, cache: bool) -> None:
        """Take back `req`'s row and slots. `cache`: it finished, so its prompt
        and output go into the tree for later requests (the tokens whose KV is,
        or will be by a step already sent, in its slots), its last partly
        filled page too. Otherwise (retraction, abort) only its own tail is
        freed and its prefix unlocked."""
        if not req.req_pool_idx:
            return
        row = self.table[req.req_pool_idx]
        kept = req.cached_prefix_len
        if cache and self.tree is not None:
            kept = min(req.kv_len, req.num_tokens)
            if kept > req.cached_prefix_len:
                self._insert_own(req, req.fill_ids[:kept], row[:kept].astype(np.int64))
        end_of_kept = self.pages_for(kept)  # a page the tree took part of is the tree's
        if req.kv_len > end_of_kept:
            self._free(row[end_of_kept:req.kv_len].astype(np.int64))
        copy = self.pending_copies.pop(req.req_pool_idx, None)
        if copy is not None:  # admitted, never sent
            assert self.tree is not None
            self.tree.unlock(copy.node)
        self._unlock(req)
        del self.resident[req.req_pool_idx]
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = 0
        req.kv_len = req.cached_prefix_len = req.table_sync_len = req.window_from = 0
        req.penalty_state_sent = False  # its next row gets its state rebuilt at its extend

    def _unlock(self, req: Req) -> None:
        if req.last_node is not None:
            assert self.tree is not None
            self.tree.unlock(req.last_node)
            req.last_node = None

    def flush(self) -> None:
        """Empty the tree; the caller checked that no request is resident."""
        if self.tree is not None:
            self.tree.reset()

    # ---- accounts ------------------------------------------------------------------------

    def own_slots(self, req: Req) -> int:
        """Slots of the pages `req` holds itself (from cached_prefix_len, a page boundary)."""
        return self.pages_for(req.kv_len) - req.cached_prefix_len

    def stats(self) -> dict[str, Any]:
        tree = self.tree
        return {
            "free_kv_slots": self.allocator.available(),
            "touched_kv_slots": self.allocator.touched_slots(),  # ever handed out: the pool's resident part
            "evictable_kv_slots": tree.evictable_size if tree else 0,
            "protected_kv_slots": tree.protected_size if tree else 0,
            "held_kv_slots": self.size - self.available(),  # by requests, directly or by lock
            "total_kv_slots": self.size,
            "page_size": self.page_size,
            "free_req_rows": self.req_to_token_pool.available(),
            "total_req_rows": self.req_to_token_pool.num_rows,
            "radix_tree_nodes": tree.num_nodes() if tree else 0,
            "cache_hit_rate": self.matched_tokens / self.offered_tokens if self.offered_tokens else 0.0,
            **({"free_window_kv_slots": self.window_pool.available(),
                "total_window_kv_slots": self.window_pool.size} if self.window_pool is not None else {}),
        }
