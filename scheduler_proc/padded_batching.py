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
from typing import Callable

from common.messages import ForwardMode, ModelInfo, ToTokenizerMsg
from common.server_args import ServerArgs
from scheduler_proc.model_client import LocalModel, ModelClient
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import ScheduleBatch
from scheduler_proc.scheduler import Scheduler


class PaddedBatchScheduler(Scheduler):
    prefix_cache_allowed = False
    padded_row_steps = 1

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Static and dynamic batching: a batch runs, padded, until its longest row
        finishes; nothing joins it mid-flight."""
        batch = self.running_batch
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            batch = self.running_batch = self.last_batch
        if batch is not None:
            if self.inflight and all(r.finished or r.finishes_with_pending(self.context_len)
                                     for r in batch.reqs):
                self.resolve_inflight()  # the batch may be over: see its last tokens first
            if all(r.finished for r in batch.reqs):
                for r in batch.reqs:
                    self.release_req(r)
                self.running_batch = None
            else:
                # a finished row whose padding would run past the context is dropped
                too_long = [i for i, r in enumerate(batch.reqs)
                            if r.finished and r.kv_len + 1 >= self.context_len]
                if too_long:
                    for i in too_long:
                        self.release_req(batch.reqs[i])
                    batch.filter_batch([i for i in range(len(batch)) if i not in too_long])
                batch.prepare_for_decode(self.cache)
                return batch
        if not self.waiting_queue:
            self.new_token_ratio = self.init_new_token_ratio
            return None
        if self.args.batching == "dynamic":
            waited_ms = (time.time() - self.waiting_queue[0].arrival_time) * 1000
            if len(self.waiting_queue) < self.args.max_running_requests and \
                    waited_ms < self.args.batch_timeout_ms:
                return None
        # Every row may be padded to the longest row's length: reserve that for all.
        reqs: list[Req] = []
        longest = 0
        for req in self.waiting_queue:
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
            self.waiting_queue.popleft()
        for r in reqs:
            self.cache.admit(r, None)
            r.extend_input_len = 0
        return self.start_prefill(reqs, 0)

    def in_running_batch(self, req: Req) -> bool:
        # a batch just prefilled is still last_batch: it becomes the running
        # batch when the next step is chosen
        return any(b is not None and any(r is req for r in b.reqs)
                   for b in (self.running_batch, self.last_batch))

    def release_ended(self, req: Req) -> None:
        """A row ended out of turn keeps its KV as padding until the batch ends."""
        if self.in_running_batch(req):
            self.reqs_by_rid.pop(req.rid, None)  # the rid is free for reuse
        else:
            self.release_req(req)

    def retire_finished(self, req: Req) -> None:
        """The row stays as padding; the rid is free for reuse."""
        self.reqs_by_rid.pop(req.rid, None)


def create_scheduler(server_args: ServerArgs, model_info: ModelInfo, model: ModelClient | LocalModel,
                     send_output: Callable[[ToTokenizerMsg], None]) -> Scheduler:
    """The scheduler --batching asks for: continuous (Scheduler), or a padded baseline."""
    cls = Scheduler if server_args.batching == "continuous" else PaddedBatchScheduler
    return cls(server_args, model_info, model, send_output)
