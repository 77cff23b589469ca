"""The scheduler loop: receive, choose a prefill or a decode batch, launch it,
resolve results. The jobs are the parts' (request_queue, prefill_manager,
decode_manager, output_processor, new_token_ratio); this module only sequences
them and owns the request's lifecycle verbs (docs/architecture.md)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from common.messages import (AbortKind, AbortReq, FinishAbort, FinishMatchedStr, FinishReason, ForwardMode, ModelInfo,
                             StopMatchedReq, TokenizedGenerateReq, ToSchedulerMsg, ToTokenizerMsg)
from common.server_args import ServerArgs
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.decode_manager import DecodeManager
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.model_client import LocalModel, ModelClient, as_model_client
from scheduler_proc.new_token_ratio import NewTokenRatio
from scheduler_proc.output_processor import LaunchedStep, OutputProcessor
from scheduler_proc.prefill_manager import PrefillManager
from scheduler_proc.queries import answer
from scheduler_proc.req import Req
from scheduler_proc.request_queue import RequestQueue, default_queue_limit  # noqa: F401 (re-exported)
from scheduler_proc.schedule_batch import NEEDS_RESULTS, NeedsResults, ScheduleBatch
from scheduler_proc.speculative.policy import Speculator
from scheduler_proc.timeline import Timeline
from scheduler_proc.watchdog import Watchdog

logger = logging.getLogger(__name__)

Choice = ScheduleBatch | NeedsResults | None  # what a batch chooser returns


class Scheduler:
    """Continuous batching (SGLang's loop). Static and dynamic batching, the
    padded baselines, choose batches their own way: scheduler_proc/padded_batching.py."""

    prefix_cache_allowed = True  # rows leave as soon as they finish, so the cache can take their KV
    padded_row_steps = 0  # a finished row still computed counts as a row-step (padding) or not

    def __init__(self, server_args: ServerArgs, model_info: ModelInfo,
                 model: ModelClient | LocalModel,
                 send_output: Callable[[ToTokenizerMsg], None]) -> None:
        self.args = server_args
        self.model_info = model_info
        self.model = as_model_client(model)  # a local model runs each batch when it is sent
        self.send_output = send_output
        self.context_len = model_info.context_len
        # Overlap: send step t+1 before processing step t's result (see step()).
        self.overlap = not server_args.disable_overlap_schedule
        self.inflight: deque[LaunchedStep] = deque()  # sent, result not yet processed
        self.last_result_time = 0.0
        self.watchdog = Watchdog(server_args.watchdog_timeout, lambda msg: self.send_output(msg))
        self.radix_cache_enabled = not server_args.disable_radix_cache and self.prefix_cache_allowed
        self.cache = CacheManager(model_info.max_total_tokens, server_args.max_running_requests,
                                  self.context_len, use_tree=self.radix_cache_enabled,
                                  page_size=server_args.page_size,
                                  max_idle_cached=None if server_args.prefix_cache_max_idle_tokens == -1
                                  else server_args.prefix_cache_max_idle_tokens,
                                  window=(model_info.sliding_window, model_info.window_pool_tokens)
                                  if model_info.window_pool_tokens else None)
        self.invariant_error: str | None = None  # set when the idle check finds the accounts off
        self.timeline = Timeline()
        self.ratio = NewTokenRatio(server_args.schedule_conservativeness)
        self.queue = RequestQueue(server_args, model_info, self.cache.size, self.cache.pages_for)
        self.prefill = PrefillManager(server_args, self.cache, self.queue, self.timeline)
        self.speculator = Speculator(server_args, model_info.step_cost, self.context_len) \
            if server_args.speculative_algorithm else None
        self.decode = DecodeManager(server_args, self.context_len, self.cache, self.queue, self.prefill,
                                    self.ratio, self.timeline, end=self.end, speculator=self.speculator)
        self.output = OutputProcessor(self.context_len, server_args.stream_interval, self.cache,
                                      self.timeline, lambda msg: self.send_output(msg),
                                      retire=self.retire, padded_row_steps=self.padded_row_steps,
                                      speculator=self.speculator)
        self.last_batch: ScheduleBatch | None = None
        self.num_consecutive_prefill = 0
        self.resuming_decode = False  # the last choice was a decode step that needed results first

    # ---- input ------------------------------------------------------------------------

    def process_input_requests(self, msgs: list[ToSchedulerMsg]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.end_rid(msg.rid, FinishAbort(AbortKind.CLIENT_GONE, "aborted by the client"))
            elif isinstance(msg, StopMatchedReq):  # a stop: its tokens are as good as any, and cached
                self.end_rid(msg.rid, FinishMatchedStr(msg.matched))
            else:  # a query
                self.send_output(answer(self, msg))

    def handle_generate_request(self, msg: TokenizedGenerateReq) -> None:
        req = self.queue.add(msg)
        if req is None:
            return
        self.timeline.request(req.rid, "arrived", prompt_tokens=len(req.origin_input_ids),
                              max_new_tokens=req.sampling_params.max_new_tokens)
        if req.finished:  # refused
            self.output.stream([req])

    def end_rid(self, rid: str, reason: FinishReason) -> None:
        """Ends `rid` now, if it is still live, with `reason`."""
        req = self.queue.by_rid.get(rid)
        if req is not None and not req.finished:
            req.finish = reason
            self.end(req)

    # ---- the lifecycle verbs: waiting -> running -> finished, and back by retract ----

    def end(self, req: Req) -> None:
        """A request given its finish reason out of turn (an abort, a deadline,
        a stop string, a refusal) leaves wherever it is, and its client is told.
        A running row keeps its place only until the next filter, and its KV is
        freed now: a step still in flight that writes those slots (overlap) runs
        before any step that could reuse them."""
        if not req.req_pool_idx:  # it was still waiting (its state before the finish reason)
            self.queue.remove(req)
        if req is self.prefill.chunked_req:
            self.prefill.chunked_req = None
        self.leave(req)
        self.output.stream([req])

    def retire(self, req: Req) -> None:
        """A row that finished on the token it sampled leaves at once."""
        self.leave(req)

    def leave(self, req: Req) -> None:
        """The request is finished: its rid is free, and its KV goes back (a
        request that finished, not aborted, leaves its prompt and output in
        the prefix cache) unless the batch keeps its row as padding."""
        self.queue.forget(req)
        if self.speculator is not None and not req.aborted:
            self.speculator.finished(req)
        if not self.keeps_as_padding(req):
            self.cache.release(req, cache=not req.aborted)

    def keeps_as_padding(self, req: Req) -> bool:
        return False  # continuous batching: a finished row never stays

    # ---- choosing the next batch ------------------------------------------------------

    def get_next_batch_to_run(self) -> Choice:
        """A prefill batch, a decode batch, nothing to run, or NEEDS_RESULTS
        (the caller processes the step in flight and asks again)."""
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            self.decode.absorb(self.last_batch)
            self.last_batch = None  # absorbed once, even if asked again before step() ends
        self.decode.filter()
        resuming_decode, self.resuming_decode = self.resuming_decode, False
        running = self.decode.running_batch
        decode_due = running is not None and \
            (resuming_decode or self.num_consecutive_prefill >= self.args.max_consecutive_prefill_batches)
        if not decode_due:
            choice = self.next_prefill()
            if choice is not None:
                return choice
        self.num_consecutive_prefill = 0
        if running is None:
            if not self.queue.waiting and self.prefill.chunked_req is None:
                self.ratio.reset()  # idle
            return None
        choice = self.decode.next_decode(step_in_flight=bool(self.inflight))
        self.resuming_decode = choice is NEEDS_RESULTS
        return choice

    def next_prefill(self) -> ScheduleBatch | NeedsResults | None:
        batch = self.prefill.build(self.decode.running, self.ratio.value)
        blocked = self.prefill.blocked
        if batch is None and blocked is not None and self.args.priority_preemption \
                and self.prefill.chunked_req is None and self.decode.can_preempt_for(blocked):
            if self.inflight:  # a victim's pending token would be lost
                return NEEDS_RESULTS
            if self.decode.preempt_for(blocked):
                batch = self.prefill.build(self.decode.running, self.ratio.value)  # now it fits
        if batch is None:
            return None
        # only prefills that make running rows wait count towards the bound
        if self.decode.running_batch is not None and not self.decode.mix_into(batch):
            self.num_consecutive_prefill += 1
        self.prefill.cache_prefill(batch)
        return batch

    def choose(self) -> ScheduleBatch | None:
        """The only place results are resolved for a choice."""
        while (choice := self.get_next_batch_to_run()) is NEEDS_RESULTS:
            self.resolve_inflight()
        return choice

    # ---- running it -------------------------------------------------------------------

    def launch_batch(self, batch: ScheduleBatch) -> None:
        """Send the step to the model; its result is processed by resolve_oldest."""
        fb = batch.to_forward_batch()
        # a row whose prompt is not all in the pool yet samples nothing it keeps
        produces = [batch.keeps_token(i, s) for i, s in enumerate(fb.seq_lens)]
        for r, p in zip(batch.reqs, produces):
            r.pending_tokens += p
        self.model.send(fb)
        # a spent thinking budget's forced token depends on this step's: no overlap either
        needs_result = bool(fb.grammar_rows) or batch.forward_mode is ForwardMode.VERIFY or any(
            r.thinking is not None and r.thinking.forces_soon(r.pending_tokens) for r in batch.reqs)
        self.inflight.append(LaunchedStep(batch.forward_mode, list(batch.reqs), produces,
                                          len(fb.out_cache_loc), time.perf_counter(),
                                          fb.input_logprob_rows, needs_result,
                                          len(batch) - batch.decode_from, batch.draft_lens))

    def resolve_oldest(self) -> None:
        result = self.model.recv()  # the step stays in flight while we wait: the watchdog measures it
        step = self.inflight.popleft()
        now = time.perf_counter()
        # the model's share of the wall time: from launch, or from the previous
        # result when this step queued behind it
        step_time = now - max(step.launch_time, self.last_result_time)
        self.last_result_time = now
        self.output.process(step, result, num_waiting=len(self.queue.waiting))
        self.timeline.step(kind=step.forward_mode.value, batch_size=len(step.reqs),
                           tokens=step.num_tokens, kv_usage=self.cache.token_usage(),
                           step_time=step_time, accepted=sum(result.accept_lens) - len(result.accept_lens))

    def resolve_inflight(self) -> None:
        while self.inflight:
            self.resolve_oldest()

    # ---- liveness ---------------------------------------------------------------------

    def model_silent_s(self, now: float) -> float:
        """Seconds the model has owed a result: since the oldest step in flight
        was sent, or since the last result if it queued behind that one."""
        if not self.inflight:
            return 0.0
        return now - max(self.inflight[0].launch_time, self.last_result_time)

    def tick(self) -> None:
        """Every loop iteration, and every HEARTBEAT_S while waiting for the
        model: the watchdog and the heartbeat (scheduler_proc/watchdog.py)."""
        self.watchdog.tick(self.model_silent_s(time.perf_counter()))

    # ---- loop ---------------------------------------------------------------------------

    def step(self) -> ScheduleBatch | None:
        """One iteration after input was processed: pick a batch, send it, retire rows.

        Plain loop: send step t, then read and process its result. Overlap: send
        step t+1, then read and process step t's result while the model runs
        t+1, so the scheduler's own work hides behind the forward. With nothing
        new to send, every result still out is processed."""
        for req in self.queue.expired(time.time()):
            self.end(req)
        for req in self.queue.take_compiled():  # their grammar did not compile
            self.end(req)
        if any(step.next_needs_result for step in self.inflight):
            # a constrained row's next mask needs the token in flight, a row
            # after a verify its kept tokens: this step runs without overlap
            # (see scheduler_proc/grammar.py, scheduler_proc/speculative/)
            self.resolve_inflight()
        batch = self.choose()
        if batch is None and self.inflight:
            # nothing to send until the step out is processed (its finished rows
            # give back their KV and table rows): catch up, then look again
            self.resolve_inflight()
            batch = self.choose()
        if batch is not None:
            self.launch_batch(batch)
        keep_in_flight = 1 if self.overlap and batch is not None else 0
        while len(self.inflight) > keep_in_flight:
            self.resolve_oldest()
        self.last_batch = batch
        return batch

    def is_idle(self) -> bool:
        return not self.queue and self.decode.running_batch is None and \
            self.prefill.chunked_req is None and not self.inflight and \
            (self.last_batch is None or self.last_batch.forward_mode is not ForwardMode.EXTEND)

    def check_invariant(self) -> None:
        """Every KV slot and table row accounted for exactly once (checked when
        the server goes idle; an error is logged and shown in /get_server_info)."""
        error = check_kv_invariant(self.cache)
        if error is not None and error != self.invariant_error:
            logger.error("KV cache accounts are off: %s", error)
        self.invariant_error = error

    def event_loop(self, recv_requests: Callable[[float | None], list[ToSchedulerMsg]]) -> None:
        """`recv_requests(timeout_s)` drains the input socket, first waiting up to
        timeout_s (None: until something comes) for a message."""
        ran = True
        while True:
            self.tick()
            if self.is_idle():
                if ran:
                    self.check_invariant()
                timeout = None
            elif not ran:  # waiting for a dynamic batch's timeout: don't spin
                timeout = 0.002
            else:
                timeout = 0.0
            self.process_input_requests(recv_requests(timeout))
            ran = self.step() is not None
