"""PrefillAdder: the admission budget of one prefill batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler_proc.memory import slots_taken
from scheduler_proc.req import Req

# A request's remaining max_new_tokens counts at most this much in the estimate
# (SGLang's CLIP_MAX_NEW_TOKENS): a huge max_new_tokens should not block admission.
CLIP_MAX_NEW_TOKENS = 4096


def expected_new_tokens(req: Req, new_token_ratio: float) -> int:
    """How many more KV slots `req` is expected to need while decoding.

    A request that ignores EOS runs to max_new_tokens for sure: ratio 1.0."""
    ratio = 1.0 if req.sampling_params.ignore_eos else new_token_ratio
    return math.ceil(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * ratio)


@dataclass(slots=True, frozen=True)
class Admitted:
    """A request taken into a prefill batch, and how many of its tokens after
    its kv_len that prefill computes (all the rest, or a chunk)."""

    req: Req
    extend_len: int


@dataclass
class PrefillAdder:
    """Admits waiting requests while every budget holds. It only keeps
    accounts: what it admits is its `can_run` list, and no request is changed.

    `rem_total_tokens` starts as the available KV slots (free, or cached
    and evictable) minus what the running
    requests are still expected to need; each admitted request takes its
    uncached prompt plus its own expected remainder out of it.
    `rem_chunk_tokens` (None: no chunking) caps the tokens this prefill
    computes: the request that crosses it is cut, and the rest of its prompt
    goes in later prefill batches. `rem_window_tokens` (None: no window
    pool) caps them too: every token a prefill computes takes a window-pool
    slot until the step after it, whatever the request's length.
    """

    rem_running: int  # free places in the running batch
    rem_total_tokens: float  # KV slots not promised to anyone
    rem_prefill_tokens: int  # --max-prefill-tokens still unused
    rem_chunk_tokens: int | None  # --chunked-prefill-size still unused
    new_token_ratio: float
    page_size: int = 1  # KV slots come in pages: a request's tokens take whole pages
    rem_window_tokens: int | None = None  # window-pool slots still unused (sliding-window models)
    can_run: list[Admitted] = field(default_factory=list)
    new_chunked_req: Req | None = None  # admitted with only part of its prompt

    @classmethod
    def for_step(cls, *, max_running: int, running: list[Req], free_slots: int,
                 max_prefill_tokens: int, chunked_prefill_size: int,
                 new_token_ratio: float, page_size: int = 1,
                 free_window_slots: int | None = None) -> "PrefillAdder":
        reserved = sum(expected_new_tokens(r, new_token_ratio) for r in running)
        # each running row may open a window page in the decode step after this one
        window = None if free_window_slots is None else free_window_slots - page_size * len(running)
        return cls(rem_running=max_running - len(running),
                   rem_total_tokens=free_slots - reserved,
                   rem_prefill_tokens=max_prefill_tokens,
                   rem_chunk_tokens=None if chunked_prefill_size < 0 else chunked_prefill_size,
                   new_token_ratio=new_token_ratio, page_size=page_size, rem_window_tokens=window)

    def add_chunked_req(self, req: Req, free_slots: int) -> None:
        """The next chunk of a prompt admitted earlier: its KV budget was promised
        then, so only the chunk size and the slots free right now bound it."""
        extend = req.num_tokens - req.kv_len
        if self.rem_chunk_tokens is not None:
            extend = min(extend, self.rem_chunk_tokens)
        room = -req.kv_len % self.page_size  # left in its last page
        extend = min(extend, room + max(free_slots, 0) // self.page_size * self.page_size,
                     self._window_cap(extend))
        if extend <= 0:
            return
        if req.kv_len + extend < req.num_tokens:
            self.new_chunked_req = req
        self._admit(req, extend, promised=slots_taken(req.kv_len, extend, self.page_size))

    def fit(self, req: Req, prefix_len: int = 0, newly_protected: int = 0) -> tuple[int, int] | None:
        """Whether `req` would be admitted now: (the tokens it would compute in
        this prefill, the KV slots it would be promised), or None. Changes
        nothing. `prefix_len` tokens come from the prefix cache (shared
        pages, then maybe rows copied into a page of its own); locking them
        takes `newly_protected` evictable slots out of what the budget counted
        as available."""
        if self.rem_running <= 0 or self.new_chunked_req is not None:
            return None
        extend = req.num_tokens - prefix_len
        # the whole remaining prompt must fit, even when only a chunk runs now,
        # so that a chunked request can always finish its prefill; its own
        # pages start at the last page boundary of the prefix (rows of a page
        # the match ends inside are copied into the first of them)
        own_from = prefix_len - prefix_len % self.page_size
        need = slots_taken(own_from, req.num_tokens - own_from, self.page_size) \
            + expected_new_tokens(req, self.new_token_ratio) + newly_protected
        if need > self.rem_total_tokens:
            return None
        # one request longer than the prefill budget still runs, alone
        if extend > self.rem_prefill_tokens and self.can_run:
            return None
        if self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens:
            if self.rem_chunk_tokens <= 0:
                return None
            extend = self.rem_chunk_tokens
        extend = self._window_cap(extend, newly_protected)
        if extend <= 0:
            return None
        return extend, need

    def _window_cap(self, extend: int, newly_protected: int = 0) -> int:
        """`extend` cut to what the window pool has left: a page kept for
        where the request's own pages start, and the window pages of cached
        prefixes its match would lock (at most its newly protected slots)."""
        if self.rem_window_tokens is None:
            return extend
        room = self.rem_window_tokens - self.page_size - newly_protected
        return min(extend, room // self.page_size * self.page_size)

    def try_add(self, req: Req, prefix_len: int = 0, newly_protected: int = 0) -> bool:
        """Admit `req` if it fits (see `fit`); False means stop adding, so the
        queue's order is kept."""
        fit = self.fit(req, prefix_len, newly_protected)
        if fit is None:
            return False
        extend, need = fit
        if prefix_len + extend < req.num_tokens:
            self.new_chunked_req = req
        self._admit(req, extend, promised=need)
        if self.rem_window_tokens is not None:
            self.rem_window_tokens -= newly_protected
        return True

    def _admit(self, req: Req, extend: int, promised: float) -> None:
        """Take `req` into this batch: it computes `extend` tokens now and is
        promised `promised` KV slots of the budget."""
        self.can_run.append(Admitted(req, extend))
        self.rem_running -= 1
        self.rem_total_tokens -= promised
        self.rem_prefill_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        if self.rem_window_tokens is not None:
            self.rem_window_tokens -= extend + self.page_size
