"""DecodeManager: the running batch (merged into, filtered), its decode steps,
and the two ways running requests are sent back to wait: retraction when the
KV pool runs dry, and preemption by a request of higher priority."""

from __future__ import annotations

import logging
import time
from typing import Callable

from common.messages import AbortKind
from common.server_args import ServerArgs
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.new_token_ratio import NewTokenRatio
from scheduler_proc.prefill_manager import PrefillManager
from scheduler_proc.req import Req
from scheduler_proc.request_queue import RequestQueue
from scheduler_proc.schedule_batch import NEEDS_RESULTS, NeedsResults, ScheduleBatch
from scheduler_proc.speculative.policy import Speculator
from scheduler_proc.timeline import Timeline

logger = logging.getLogger("scheduler_proc.scheduler")  # the retraction lines operators grep


class DecodeManager:
    """`end(req)`: the scheduler's verb for a request ended out of turn (here:
    one the pool cannot hold even alone)."""

    def __init__(self, args: ServerArgs, context_len: int, cache: CacheManager, queue: RequestQueue,
                 prefill: PrefillManager, ratio: NewTokenRatio, timeline: Timeline,
                 end: Callable[[Req], None], speculator: Speculator | None = None) -> None:
        self.args = args
        self.speculator = speculator
        self.context_len = context_len
        self.cache = cache
        self.queue = queue
        self.prefill = prefill
        self.ratio = ratio
        self.timeline = timeline
        self.end = end
        self.running_batch: ScheduleBatch | None = None
        self.total_retractions = 0
        self.num_mixed_steps = 0  # prefill steps the running rows decoded in (--enable-mixed-chunk)

    @property
    def running(self) -> list[Req]:
        return self.running_batch.reqs if self.running_batch is not None else []

    def keeps_running(self, req: Req) -> bool:
        return not req.finished and not req.finishes_with_pending(self.context_len)

    def absorb(self, prefilled: ScheduleBatch) -> None:
        """The rows just prefilled join the running batch, minus those already
        done and the one still in a chunked prefill. With overlap, the last
        step's tokens are not known yet: a row whose pending token ends it by
        length leaves now, one that stops on a stop token leaves a step late
        (its extra token is thrown away)."""
        prefilled.filter_batch([i for i, r in enumerate(prefilled.reqs)
                                if self.keeps_running(r) and r is not self.prefill.chunked_req])
        if prefilled.is_empty():
            return
        if self.running_batch is None:
            self.running_batch = prefilled
        else:
            self.running_batch.merge_batch(prefilled)

    def filter(self) -> None:
        batch = self.running_batch
        if batch is not None:
            batch.filter_batch([i for i, r in enumerate(batch.reqs) if self.keeps_running(r)])
            if batch.is_empty():
                self.running_batch = None

    def mix_into(self, batch: ScheduleBatch) -> bool:
        """--enable-mixed-chunk: the running rows take their decode step inside
        this prefill step (SGLang's mixed chunk): one pass over the weights
        for both, and no running row waits for the prefill. They come back as
        running rows when the step's rows are absorbed. Not when the pool lacks
        a slot per row: then they wait, and their own decode step retracts."""
        running = self.running_batch
        if not self.args.enable_mixed_chunk or running is None \
                or not self.cache.can_decode(running.reqs):
            return False
        running.prepare_for_decode(self.cache)
        batch.mix_with_running(running)
        self.running_batch = None
        self.num_mixed_steps += 1
        return True

    def next_decode(self, step_in_flight: bool) -> ScheduleBatch | NeedsResults:
        """The running batch prepared for one more token per row, retracting if
        the pool is short. Short with a step in flight, its result comes first:
        its finished rows free their KV, and victims must have all their tokens."""
        batch = self.running_batch
        assert batch is not None
        spec = self.speculator
        if spec is not None and spec.may_pay(batch.reqs):
            if step_in_flight:  # drafts follow the last token, and a verify's result sets kv_len
                return NEEDS_RESULTS
            drafts = spec.propose(batch.reqs)
            if drafts is not None and self.cache.can_alloc(batch.reqs, [1 + len(d) for d in drafts]):
                self.ratio.decay()
                batch.prepare_for_verify(self.cache, drafts)
                return batch
        if not self.cache.can_decode(batch.reqs):
            if step_in_flight:
                return NEEDS_RESULTS
            self.retract_decode(batch)
        else:
            self.ratio.decay()
        batch.prepare_for_decode(self.cache)
        return batch

    def retract_decode(self, batch: ScheduleBatch) -> None:
        """Free the KV of victims (fewest decoded tokens first, ties to the longest
        prompt) until every remaining row can get a slot; victims go back to the
        front of the queue with their tokens, to be recomputed when re-admitted."""
        order = sorted(range(len(batch)), key=lambda i: (len(batch.reqs[i].output_ids),
                                                          -len(batch.reqs[i].origin_input_ids)))
        retracted: list[Req] = []
        keep = set(range(len(batch)))

        def fits() -> bool:
            return self.cache.can_decode([batch.reqs[k] for k in keep])
        for i in order:
            if fits():
                break
            chunked = self.prefill.chunked_req
            if len(keep) == 1 and chunked is not None:
                # the half-prefilled request holds the slots: it goes back instead
                self.retract(chunked)
                retracted.append(chunked)
                self.prefill.chunked_req = None
                if fits():
                    break
            if len(keep) == 1:  # cannot happen after validate(); never loop forever
                req = batch.reqs[i]
                req.abort(AbortKind.SERVER_ERROR, f"the KV pool ({self.cache.size} tokens) cannot hold this request")
                self.end(req)
                keep.discard(i)
                break
            req = batch.reqs[i]
            self.retract(req)
            retracted.append(req)
            keep.discard(i)
        batch.filter_batch(sorted(keep))
        for req in reversed(retracted):  # the first victim ends up first in the queue
            self.queue.waiting.appendleft(req)
        self.total_retractions += len(retracted)
        old_ratio = self.ratio.after_retraction(batch.reqs)
        logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                    "#new_token_ratio: %.4f -> %.4f", len(retracted), old_ratio, self.ratio.value)

    def retract(self, req: Req) -> None:
        """running -> retracted: free its KV; it keeps its tokens and is
        recomputed when admitted again. The caller puts it back in the queue."""
        self.cache.release(req, cache=False)
        req.num_retractions += 1
        req.waiting_since = time.time()
        self.timeline.request(req.rid, "retracted", decoded=len(req.output_ids))

    # ---- priority preemption ----------------------------------------------------------

    def outranks(self, a: Req, b: Req) -> bool:
        """a has strictly higher priority than b."""
        return a.priority < b.priority if self.args.schedule_low_priority_values_first else a.priority > b.priority

    def can_preempt_for(self, blocked: Req) -> bool:
        return any(self.outranks(blocked, r) for r in self.running)

    def preempt_for(self, blocked: Req) -> bool:
        """--priority-preemption: `blocked` (the first waiting request, which
        does not fit) retracts running requests of strictly lower priority,
        lowest first (then least decoded), until it would fit. They resume
        from the queue, as after any retraction. No step may be in flight: a
        victim's pending token would be lost."""
        sign = -1 if self.args.schedule_low_priority_values_first else 1  # lowest priority first
        victims = sorted((r for r in self.running if self.outranks(blocked, r)),
                         key=lambda r: (sign * r.priority, len(r.output_ids), -len(r.origin_input_ids)))
        retracted: list[Req] = []
        for victim in victims:
            if self.prefill.would_admit(blocked, self.running, self.ratio.value):
                break
            self.retract(victim)
            retracted.append(victim)
            self.running_batch.filter_batch([i for i, r in enumerate(self.running_batch.reqs) if r is not victim])
        if self.running_batch is not None and self.running_batch.is_empty():
            self.running_batch = None
        self.queue.waiting.extend(retracted)  # the queue is ordered by priority before each admission
        self.total_retractions += len(retracted)
        if retracted:
            logger.info("Priority preemption: %d running request(s) of lower priority retracted for %s "
                        "(priority %d)", len(retracted), blocked.rid, blocked.priority)
        return bool(retracted)
