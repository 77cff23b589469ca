"""The scheduler loop: receive, choose a prefill or a decode batch, run it, retire rows."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Protocol

from common.messages import (AbortReq, BatchTokenOut, ForwardBatch, ForwardResult, ModelInfo,
                             TokenizedGenerateReq, ToSchedulerMsg)
from common.server_args import ServerArgs
from scheduler_proc.memory import ReqToTokenPool, TokenSlotAllocator
from scheduler_proc.prefill_adder import PrefillAdder
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch." log lines, as SGLang


class ModelClient(Protocol):
    """Runs one step on the model: over ZMQ in the server, in-process in tests."""

    def forward(self, batch: ForwardBatch) -> ForwardResult: ...


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_info: ModelInfo, model: ModelClient,
                 send_output: Callable[[BatchTokenOut], None]) -> None:
        self.args = server_args
        self.model_info = model_info
        self.model = model
        self.send_output = send_output
        self.context_len = model_info.context_len
        self.req_to_token_pool = ReqToTokenPool(server_args.max_running_requests, self.context_len)
        self.allocator = TokenSlotAllocator(model_info.max_total_tokens)

        self.waiting_queue: deque[Req] = deque()
        self.running_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.reqs_by_rid: dict[str, Req] = {}  # every request not yet finished
        # Until retraction exists, admission promises every running request its
        # whole remaining max_new_tokens, so a decode step can never run out of slots.
        self.new_token_ratio = 1.0

        self.num_decode_steps = 0
        self.decode_tokens_since_log = 0
        self.last_decode_log_time = time.perf_counter()

    # ---- input ------------------------------------------------------------------------

    def process_input_requests(self, msgs: list[ToSchedulerMsg]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)

    def handle_generate_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req.from_message(msg, self.model_info.eos_token_ids)
        if msg.rid in self.reqs_by_rid:
            # The tokenizer process refuses duplicates; answering this one would
            # finish the request that owns the rid, so it is dropped.
            logger.error("dropping request with duplicate rid %r", msg.rid)
            return
        error = self.validate(req)
        if error:
            req.abort(error)
            self.stream_output([req])
            return
        self.reqs_by_rid[req.rid] = req
        self.waiting_queue.append(req)

    def validate(self, req: Req) -> str | None:
        """The tokenizer process already checks these; a scheduler never trusts a peer."""
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty"
        if n + req.sampling_params.max_new_tokens > self.context_len:
            return (f"prompt ({n} tokens) plus max_new_tokens "
                    f"({req.sampling_params.max_new_tokens}) exceeds the context length "
                    f"({self.context_len})")
        if n + req.sampling_params.max_new_tokens > self.allocator.size:
            return (f"prompt ({n} tokens) plus max_new_tokens "
                    f"({req.sampling_params.max_new_tokens}) can never fit in the KV pool "
                    f"({self.allocator.size} tokens)")
        return None

    def abort_request(self, rid: str) -> None:
        req = self.reqs_by_rid.get(rid)
        if req is None or req.finished:
            return
        req.abort("aborted by the client")
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        # A running row keeps its place in the batch until the next filter_batch;
        # its KV is freed now, between steps, when no forward is reading it.
        self.release_req(req)
        self.stream_output([req])

    # ---- choosing the next batch ------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # The rows just prefilled join the running batch (minus those already done).
        if self.last_batch is not None and self.last_batch.forward_mode == "extend":
            self.last_batch.filter_batch()
            if not self.last_batch.is_empty():
                if self.running_batch is None:
                    self.running_batch = self.last_batch
                else:
                    self.running_batch.merge_batch(self.last_batch)
        if self.running_batch is not None:
            self.running_batch.filter_batch()
            if self.running_batch.is_empty():
                self.running_batch = None

        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch is None:
            return None
        self.running_batch.prepare_for_decode(self.req_to_token_pool, self.allocator)
        return self.running_batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue:
            return None
        running = self.running_batch.reqs if self.running_batch is not None else []
        adder = PrefillAdder.for_step(
            max_running=self.args.max_running_requests, num_running=len(running),
            free_slots=self.allocator.available(), running=running,
            max_prefill_tokens=self.args.max_prefill_tokens,
            new_token_ratio=self.new_token_ratio)
        for req in self.waiting_queue:
            if not adder.try_add(req):
                break
        if not adder.can_run:
            return None
        for _ in adder.can_run:
            self.waiting_queue.popleft()
        batch = ScheduleBatch.init_new(adder.can_run)
        batch.prepare_for_extend(self.req_to_token_pool, self.allocator)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch), batch.input_ids.numel(), sum(batch.prefix_lens), self.token_usage(),
            len(running), len(self.waiting_queue))
        return batch

    # ---- running it -------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> ForwardResult:
        return self.model.forward(batch.to_forward_batch())

    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        seq_lens = batch.seq_lens.tolist()
        for i, (req, seq_len, token) in enumerate(zip(batch.reqs, seq_lens, result.next_token_ids)):
            if req.finished:  # aborted while the step ran
                continue
            req.kv_len = seq_len
            req.output_ids.append(token)
            if req.return_logprob:
                req.output_token_logprobs.append(result.next_token_logprobs[i])
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(
                        list(zip(result.top_logprob_vals[i], result.top_logprob_ids[i])))
            req.check_finished(self.context_len)
            if req.finished:
                self.release_req(req)
        if batch.forward_mode == "decode":
            self.num_decode_steps += 1
            self.decode_tokens_since_log += len(batch)
            if self.num_decode_steps % DECODE_LOG_INTERVAL == 0:
                self.log_decode_stats()
        self.stream_output(batch.reqs)

    def release_req(self, req: Req) -> None:
        """Give back a request's KV slots and table row; it leaves every queue."""
        if req.req_pool_idx:
            table = self.req_to_token_pool.req_to_token
            self.allocator.free(table[req.req_pool_idx, :req.kv_len].long())
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = 0
            req.kv_len = 0
        self.reqs_by_rid.pop(req.rid, None)

    # ---- output -----------------------------------------------------------------------

    def stream_output(self, reqs: list[Req]) -> None:
        """Send new tokens: streaming rows every stream_interval tokens, the rest
        when they finish."""
        out = BatchTokenOut(rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[],
                            completion_tokens=[], cached_tokens=[], num_retractions=[])
        for req in reqs:
            if req.finish_sent:
                continue
            pending = len(req.output_ids) - req.sent_len
            if not req.finished:
                if not req.stream or pending == 0:
                    continue
                # the first token goes at once; later ones every stream_interval
                if req.sent_len > 0 and pending < self.args.stream_interval:
                    continue
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[req.sent_len:])
            out.finished_reasons.append(req.finished_reason)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(0)
            out.num_retractions.append(req.num_retractions)
            out.output_token_logprobs.append(req.output_token_logprobs[req.sent_len:])
            out.output_top_logprobs.append(req.output_top_logprobs[req.sent_len:])
            req.sent_len = len(req.output_ids)
            req.finish_sent = req.finished
        if out.rids:
            self.send_output(out)

    # ---- loop ---------------------------------------------------------------------------

    def step(self) -> ScheduleBatch | None:
        """One iteration after input was processed: pick a batch, run it, retire rows."""
        batch = self.get_next_batch_to_run()
        if batch is not None:
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)
        self.last_batch = batch
        return batch

    def is_idle(self) -> bool:
        return not self.waiting_queue and self.running_batch is None and (
            self.last_batch is None or self.last_batch.forward_mode != "extend")

    def event_loop(self, recv_requests: Callable[[bool], list[ToSchedulerMsg]]) -> None:
        """`recv_requests(block)` drains the input socket; it blocks only when idle."""
        while True:
            self.process_input_requests(recv_requests(self.is_idle()))
            self.step()

    # ---- stats --------------------------------------------------------------------------

    def token_usage(self) -> float:
        return 1.0 - self.allocator.available() / self.allocator.size

    def log_decode_stats(self) -> None:
        now = time.perf_counter()
        throughput = self.decode_tokens_since_log / max(now - self.last_decode_log_time, 1e-9)
        num_tokens = self.allocator.size - self.allocator.available()
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            len(self.running_batch) if self.running_batch else 0, num_tokens,
            self.token_usage(), throughput, len(self.waiting_queue))
        self.last_decode_log_time = now
        self.decode_tokens_since_log = 0
