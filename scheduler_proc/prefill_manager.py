"""PrefillManager: builds the next prefill batch from the waiting queue (its
order, the PrefillAdder's budget, the in-batch prefix check) and keeps the
request that is part way through a chunked prefill."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Literal

import numpy as np

from common.server_args import ServerArgs
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.policy import order_waiting_queue
from scheduler_proc.prefill_adder import Admitted, PrefillAdder
from scheduler_proc.radix_cache import PrefixMatch, RadixCache
from scheduler_proc.req import Req
from scheduler_proc.request_queue import RequestQueue
from scheduler_proc.schedule_batch import ScheduleBatch
from scheduler_proc.timeline import Timeline

logger = logging.getLogger("scheduler_proc.scheduler")  # the "Prefill batch." line operators grep

# a waiting request that shares at least this many uncached tokens with one
# admitted to the prefill being built waits for the next (SGLang's threshold)
IN_BATCH_PREFIX_MIN = 32


class PrefillManager:
    def __init__(self, args: ServerArgs, cache: CacheManager, queue: RequestQueue, timeline: Timeline) -> None:
        self.args = args
        self.cache = cache
        self.queue = queue
        self.timeline = timeline
        self.chunked_req: Req | None = None  # admitted, part of its prompt still to prefill
        self.blocked: Req | None = None  # the first waiting request the last build could not admit

    def adder(self, running: list[Req], new_token_ratio: float, max_running: int) -> PrefillAdder:
        return PrefillAdder.for_step(
            max_running=max_running, running=running, free_slots=self.cache.available(),
            page_size=self.cache.page_size, max_prefill_tokens=self.args.max_prefill_tokens,
            chunked_prefill_size=self.args.chunked_prefill_size, new_token_ratio=new_token_ratio,
            free_window_slots=self.cache.window_available())

    def build(self, running: list[Req], new_token_ratio: float) -> ScheduleBatch | None:
        """The next prefill batch, or None (then `blocked` says who did not fit)."""
        self.blocked = None
        waiting = self.queue.waiting
        if not waiting and self.chunked_req is None:
            return None
        # With overlap, rows that finish in the step in flight have left the running
        # batch but hold their table row (and KV) until its result is processed.
        pool = self.cache.req_to_token_pool
        held = pool.num_rows - pool.available()
        leaving = held - len(running) - (1 if self.chunked_req is not None
                                         and self.chunked_req.req_pool_idx else 0)
        adder = self.adder(running, new_token_ratio, self.args.max_running_requests - leaving)
        if self.chunked_req is not None:
            # leave every running row room for its next decode step
            adder.add_chunked_req(self.chunked_req, self.cache.available() - self.cache.decode_slots(running))
            if not adder.can_run:
                return None
        waiting = self.queue.waiting = order_waiting_queue(
            waiting, self.args.schedule_policy, self.cache.match_len if self.cache.tree else None,
            by_priority=self.args.enable_priority_scheduling,
            low_priority_first=self.args.schedule_low_priority_values_first,
            aging_s=self.args.priority_aging_s or None)
        # what this batch computes, as a tree of its own: a request that would
        # compute the same prefix again waits one batch and then takes it from
        # the cache (SGLang's in-batch prefix check, for every policy here)
        in_batch = RadixCache(lambda slots: None) if self.cache.tree is not None else None
        if in_batch is not None and self.chunked_req is not None:
            self._computed_in_batch(in_batch, adder.can_run[0])
        admitted: set[int] = set()
        for req in waiting:
            match = self.cache.match(req)
            cached = match.length if match else 0
            if in_batch is not None and cached + IN_BATCH_PREFIX_MIN <= in_batch.match_prefix(
                    req.fill_ids[:req.prefix_limit], req.cache_salt).length:
                continue
            match = self._fitting_match(adder, req, match)
            if match is False or not adder.try_add(req, prefix_len=match.length if match else 0,
                                                   newly_protected=self.cache.newly_protected(match)):
                self.blocked = req
                break
            self.cache.admit(req, match)  # its row, and its prefix locked in the tree
            admitted.add(id(req))
            if in_batch is not None:
                self._computed_in_batch(in_batch, adder.can_run[-1])
        if not adder.can_run:
            return None
        self.blocked = None
        self.queue.waiting = deque(r for r in waiting if id(r) not in admitted)
        continuing = self.chunked_req
        if continuing is not None and adder.new_chunked_req is None:
            logger.debug("chunked prefill of %s: last chunk", continuing.rid)
        self.chunked_req = adder.new_chunked_req
        return self.start(adder.can_run, len(running), continuing)

    @staticmethod
    def _computed_in_batch(in_batch: RadixCache, admitted: Admitted) -> None:
        req = admitted.req
        n = req.kv_len + admitted.extend_len
        in_batch.insert(req.fill_ids[:n], np.zeros(n, dtype=np.int64), req.cache_salt)

    def _fitting_match(self, adder: PrefillAdder, req: Req,
                       match: PrefixMatch | None) -> PrefixMatch | None | Literal[False]:
        """`match`, or, when `req` does not fit with it, the match without the
        rows it would copy (their source page stays locked until the copy is
        sent, which a tight pool may not afford); False if neither fits."""
        for m in (match, match.without_copy()) if match is not None and match.copy_node else (match,):
            if adder.fit(req, prefix_len=m.length if m else 0,
                         newly_protected=self.cache.newly_protected(m)) is not None:
                return m
        return False

    def would_admit(self, req: Req, running: list[Req], new_token_ratio: float) -> bool:
        """Whether a prefill built now would admit `req` first (no step in flight)."""
        adder = self.adder(running, new_token_ratio, self.args.max_running_requests)
        return self._fitting_match(adder, req, self.cache.match(req)) is not False

    def start(self, admitted: list[Admitted], num_running: int, continuing: Req | None = None) -> ScheduleBatch:
        """The prefill batch of the admitted requests, slots allocated;
        `continuing`: the request whose next chunk this is (not admitted now)."""
        now = time.time()
        hit_tokens = 0  # taken from the prefix cache by the requests admitted now
        reqs = [a.req for a in admitted]
        for a in admitted:
            r = a.req
            assert not r.pending_tokens, "a prefill needs every token of the request"
            hit = 0
            if r.admit_time is None:
                r.admit_time = now
                event, hit = "admitted", r.kv_len
            elif r is not continuing:
                event, hit = "readmitted", r.kv_len  # after a retraction: recomputed
            else:
                event = "chunk"  # the next chunk of a chunked prefill
            hit_tokens += hit
            self.timeline.request(r.rid, event, t=now, tokens=a.extend_len, cached_tokens=hit)
        batch = ScheduleBatch.init_new(reqs)
        batch.prepare_for_extend(self.cache, [a.extend_len for a in admitted])
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch), len(batch.input_ids), hit_tokens,
            self.cache.token_usage(), num_running, len(self.queue.waiting))
        return batch

    def cache_prefill(self, batch: ScheduleBatch) -> None:
        """What the prefill rows compute goes into the prefix cache now, as the
        step is sent, not when its result is read: a later step that reads
        these slots runs after this one (the model runs steps in order), and a
        request arriving meanwhile, or in the next chunk's batch, shares it
        (SGLang inserts after the result; with the overlap schedule that is a
        step too late for the next batch). Only once the step's every slot is
        allocated (a mixed step's running rows too): the tree may already hold
        some of these tokens, and the request's own copies are then freed;
        freed before, a running row of this same step could be handed one and
        write its token's K/V where this step also writes the prompt's."""
        for r in batch.reqs[:batch.decode_from]:
            self.cache.cache_unfinished(r, r.kv_len)
