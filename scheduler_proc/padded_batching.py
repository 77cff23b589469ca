"""Static and dynamic batching: the padded baselines of the batching study.

A batch is formed from up to --max-running-requests queued requests and runs
until its longest row finishes: a finished row keeps its place (and its KV)
and is still computed, as a padded rectangular batch would be, and nothing
joins mid-flight. Dynamic batching launches a batch when
--max-running-requests requests wait or --batch-timeout-ms has passed since
the first arrived; static launches whatever is waiting. They exist so anyone
can measure, on their own trace, the padding tax continuous batching removes.
They run without the prefix cache (finished rows keep their KV as padding).
"""

from __future__ import annotations

import time

from common.messages import ForwardMode
from scheduler_proc.prefill_adder import Admitted
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import NEEDS_RESULTS, NeedsResults, ScheduleBatch
from scheduler_proc.scheduler import Scheduler


class PaddedBatchScheduler(Scheduler):
    prefix_cache_allowed = False
    padded_row_steps = 1

    def get_next_batch_to_run(self) -> ScheduleBatch | NeedsResults | None:
        """A batch runs, padded, until its longest row finishes; nothing joins
        it mid-flight."""
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            self.decode.running_batch = self.last_batch
        batch = self.decode.running_batch
        if batch is not None:
            if self.inflight and all(r.finished or r.finishes_with_pending(self.context_len)
                                     for r in batch.reqs):
                return NEEDS_RESULTS  # the batch may be over: see its last tokens first
            if all(r.finished for r in batch.reqs):
                for r in batch.reqs:
                    self.cache.release(r, cache=False)
                self.decode.running_batch = None
            else:
                # a finished row whose padding would run past the context is dropped
                too_long = [i for i, r in enumerate(batch.reqs)
                            if r.finished and r.kv_len + 1 >= self.context_len]
                if too_long:
                    for i in too_long:
                        self.cache.release(batch.reqs[i], cache=False)
                    batch.filter_batch([i for i in range(len(batch)) if i not in too_long])
                batch.prepare_for_decode(self.cache)
                return batch
        waiting = self.queue.waiting
        if not waiting:
            self.ratio.reset()
            return None
        if self.args.batching == "dynamic":
            waited_ms = (time.time() - waiting[0].arrival_time) * 1000
            if len(waiting) < self.args.max_running_requests and waited_ms < self.args.batch_timeout_ms:
                return None
        # Every row may be padded to the longest row's length: reserve that for all.
        reqs: list[Req] = []
        longest = 0
        for req in waiting:
            if len(reqs) == self.args.max_running_requests:
                break
            m = max(longest, req.sampling_params.max_new_tokens)
            if sum(self.cache.pages_for(len(r.origin_input_ids) + m) for r in [*reqs, req]) \
                    > self.cache.available():
                break
            reqs.append(req)
            longest = m
        if not reqs:
            return None
        for _ in reqs:
            waiting.popleft()
        for r in reqs:
            self.cache.admit(r, None)
        return self.prefill.start([Admitted(r, r.num_tokens) for r in reqs], 0)  # no prefix: all

    def retire(self, req: Req) -> None:
        """The row stays as padding until its batch ends; its rid is free for reuse."""
        self.queue.forget(req)

    def keeps_as_padding(self, req: Req) -> bool:
        """A row of the batch that ends keeps its KV as padding until the batch
        ends (a batch just prefilled is still last_batch: it becomes the running
        batch when the next step is chosen)."""
        return any(b is not None and any(r is req for r in b.reqs)
                   for b in (self.decode.running_batch, self.last_batch))
