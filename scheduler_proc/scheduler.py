"""The scheduler loop: receive, choose a prefill or a decode batch, run it, retire rows."""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from common.messages import (MAX_LOGIT_BIAS, AbortReq, BatchTokenOut, ForwardMode, ForwardResult, ModelInfo,
                             SchedulerQuery, SchedulerReply, TokenizedGenerateReq, ToSchedulerMsg,
                             ToTokenizerMsg)
from common.server_args import ServerArgs
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.finish_reason import FinishMatchedStr
from scheduler_proc.grammar import GrammarBackend, ReqGrammar
from scheduler_proc.model_client import LocalModel, ModelClient, as_model_client
from scheduler_proc.policy import order_waiting_queue
from scheduler_proc.prefill_adder import PrefillAdder
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import ScheduleBatch
from scheduler_proc.timeline import MAX_EVENTS_PER_CALL, Timeline

logger = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch." log lines, as SGLang
# new_token_ratio, SGLang's defaults: start at 0.7 (times --schedule-conservativeness),
# decay over 600 decode steps to 0.14 of that; after a retraction, jump to an estimate
# that assumes every remaining row decodes RETRACT_DECODE_STEPS more tokens.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
# a waiting request that shares at least this many uncached tokens with one
# admitted to the prefill being built waits for the next (SGLang's threshold)
IN_BATCH_PREFIX_MIN = 32
QUEUE_FULL_STATUS = 503  # also a queue timeout: the client may retry
BAD_REQUEST_STATUS = 400  # refused at admission: the request can never run here


def default_queue_limit(max_running_requests: int, pool_tokens: int) -> int:
    """Waiting requests allowed without --max-queued-requests: enough to refill
    the running batch 8 times, or to fill the KV pool with 64-token requests,
    and never fewer than 128. A bounded queue turns overload into quick 503s
    instead of unbounded memory and waits."""
    return max(128, 8 * max_running_requests, pool_tokens // 64)


@dataclass
class LaunchedStep:
    """A step sent to the model whose result has not been processed yet. It keeps
    its own list of rows: the running batch changes while the step runs."""

    forward_mode: ForwardMode
    reqs: list[Req]
    produces: list[bool]  # per row: the step samples a token for it (not a mid-prompt chunk)
    num_tokens: int
    launch_time: float
    input_logprob_rows: list[int]  # rows whose prompt logprobs the result carries, in its order
    samples_constrained: bool  # it samples a token a grammar constrains: the next mask needs it
    num_decode_rows: int  # rows decoding one token (all of a decode step, the running rows of a mixed one)


class Scheduler:
    """Continuous batching (SGLang's loop). Static and dynamic batching, the
    padded baselines, override a few methods: scheduler_proc/padded_batching.py."""

    prefix_cache_allowed = True  # rows leave as soon as they finish, so the cache can take their KV
    padded_row_steps = 0  # a finished row still computed counts as a row-step (padding) or not
    def __init__(self, server_args: ServerArgs, model_info: ModelInfo,
                 model: ModelClient | LocalModel,
                 send_output: Callable[[ToTokenizerMsg], None]) -> None:
        self.args = server_args
        self.model_info = model_info
        self.model = as_model_client(model)  # a local model runs each batch when it is sent
        # Overlap: send step t+1 before processing step t's result (see step()).
        self.overlap = not server_args.disable_overlap_schedule
        self.inflight: deque[LaunchedStep] = deque()  # sent, result not yet processed
        self.last_result_time = 0.0
        self.send_output = send_output
        self.context_len = model_info.context_len
        self.radix_cache_enabled = not server_args.disable_radix_cache and self.prefix_cache_allowed
        self.cache = CacheManager(model_info.max_total_tokens, server_args.max_running_requests,
                                  self.context_len, use_tree=self.radix_cache_enabled,
                                  page_size=server_args.page_size)
        self.invariant_error: str | None = None  # set when the idle check finds the accounts off
        self.max_queued_requests = server_args.max_queued_requests if server_args.max_queued_requests \
            is not None else default_queue_limit(server_args.max_running_requests, model_info.max_total_tokens)

        self.waiting_queue: deque[Req] = deque()
        # requests whose grammar is compiling (structured output); they join
        # the waiting queue when it is done
        self.grammar_queue: list[Req] = []
        self.grammar_backend = GrammarBackend(model_info.tokenizer_path, model_info.vocab_size,
                                              model_info.eos_token_ids)
        self.running_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None  # mid-way through a chunked prefill
        self.reqs_by_rid: dict[str, Req] = {}  # every request not yet finished
        self.num_consecutive_prefill = 0
        self.timeline = Timeline()
        # time bounds, earliest first: (time.time(), rid); an entry whose
        # request finished (or whose rid was reused) is dropped when it comes up
        self.deadlines: list[tuple[float, str]] = []  # request deadlines
        self.queue_deadlines: list[tuple[float, str]] = []  # --queue-timeout-ms

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) \
            / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        # counters
        self.num_decode_steps = 0
        self.num_mixed_steps = 0  # prefill steps the running rows decoded in (--enable-mixed-chunk)
        self.total_retractions = 0
        self.useful_row_steps = 0  # rows whose step produced a token that was kept
        self.total_row_steps = 0  # rows computed (static batching also computes finished ones)
        self.decode_tokens_since_log = 0
        self.last_decode_log_time = time.perf_counter()

    # ---- input ------------------------------------------------------------------------

    def process_input_requests(self, msgs: list[ToSchedulerMsg]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid, msg.stop_matched)
            elif isinstance(msg, SchedulerQuery):
                self.send_output(self.answer_query(msg))

    def answer_query(self, query: SchedulerQuery) -> SchedulerReply:
        if query.kind == "state":
            return SchedulerReply(query_id=query.query_id, ok=True, data=self.state())
        if query.kind == "timeline":
            return SchedulerReply(query_id=query.query_id, ok=True, data={
                "now": time.time(), "seq": self.timeline.seq,
                **self.timeline_page(query)})
        if query.kind == "flush_cache":
            # Like SGLang, refused while requests are live: their prefixes are locked.
            if not self.is_idle():
                return SchedulerReply(query_id=query.query_id, ok=False,
                                      message="cannot flush the cache while requests are running "
                                              "or waiting")
            self.cache.flush()
            self.new_token_ratio = self.init_new_token_ratio
            return SchedulerReply(query_id=query.query_id, ok=True, message="Cache flushed.")
        return SchedulerReply(query_id=query.query_id, ok=False,
                              message=f"unknown query kind {query.kind!r}")

    def timeline_page(self, query: SchedulerQuery) -> dict[str, Any]:
        limit = min(query.limit, MAX_EVENTS_PER_CALL) if query.limit > 0 else MAX_EVENTS_PER_CALL
        events, more = self.timeline.since(query.since, query.after_seq, limit)
        return {"events": events, "more": more,
                "next_seq": events[-1]["seq"] if events else max(query.after_seq, 0)}

    def handle_generate_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req.from_message(msg, self.model_info.eos_token_ids)
        if msg.rid in self.reqs_by_rid:
            # The tokenizer process refuses duplicates; answering this one would
            # finish the request that owns the rid, so it is dropped.
            logger.error("dropping request with duplicate rid %r", msg.rid)
            return
        error = self.validate(req)
        if error is None and len(self.waiting_queue) + len(self.grammar_queue) >= self.max_queued_requests:
            error = f"the queue is full ({self.max_queued_requests} requests waiting)"
            req.abort(error, status_code=QUEUE_FULL_STATUS)
        elif error is not None:
            req.abort(error, status_code=BAD_REQUEST_STATUS)
        self.timeline.request(req.rid, "arrived", prompt_tokens=len(req.origin_input_ids),
                              max_new_tokens=req.sampling_params.max_new_tokens)
        if req.finished:
            self.stream_output([req])
            return
        self.reqs_by_rid[req.rid] = req
        timeout = msg.timeout_s if msg.timeout_s is not None else self.args.request_timeout_s
        if timeout is not None:
            req.deadline = req.arrival_time + timeout
            heapq.heappush(self.deadlines, (req.deadline, req.rid))
        if self.args.queue_timeout_ms is not None:
            heapq.heappush(self.queue_deadlines, (req.arrival_time + self.args.queue_timeout_ms / 1000, req.rid))
        if req.sampling_params.grammar is not None:
            req.grammar_future = self.grammar_backend.compile(req.sampling_params.grammar)
            self.grammar_queue.append(req)
        else:
            self.waiting_queue.append(req)

    def move_compiled_grammar_reqs(self) -> None:
        """Requests whose grammar compiled join the waiting queue (in arrival
        order); one whose grammar failed to compile is refused."""
        if not self.grammar_queue:
            return
        still: list[Req] = []
        for req in self.grammar_queue:
            if not req.grammar_future.done():
                still.append(req)
                continue
            error = req.grammar_future.exception()
            if error is not None:
                req.abort(f"invalid grammar: {error}", status_code=BAD_REQUEST_STATUS)
                self.reqs_by_rid.pop(req.rid, None)
                self.stream_output([req])
                continue
            req.grammar = ReqGrammar(req.grammar_future.result())
            req.grammar_future = None
            self.waiting_queue.append(req)
        self.grammar_queue = still

    def validate(self, req: Req) -> str | None:
        """The tokenizer process already checks these; a scheduler never trusts a peer."""
        n = len(req.origin_input_ids)
        sp = req.sampling_params
        max_new = sp.max_new_tokens
        if n == 0:
            return "the prompt is empty"
        # out-of-range values would overflow the batch's int64 tensors and stop the loop
        if not -1 <= sp.top_k < 2**31 or (sp.seed is not None and not -1 <= sp.seed < 2**63) \
                or max_new < 1 or not all(0 <= t < self.model_info.vocab_size
                                          for t in req.origin_input_ids):
            return "sampling parameters or token ids out of range"
        if not -2 <= sp.frequency_penalty <= 2 or not -2 <= sp.presence_penalty <= 2 \
                or not 0 < sp.repetition_penalty <= 2 or not 0 <= sp.min_new_tokens <= max_new \
                or not all(0 <= t < self.model_info.vocab_size and abs(b) <= MAX_LOGIT_BIAS
                           for t, b in sp.logit_bias.items()) \
                or (sp.stream_interval is not None and sp.stream_interval < 1):
            return "penalties, logit_bias, min_new_tokens or stream_interval out of range"
        if sp.grammar is not None and sp.min_new_tokens > 0:
            return "min_new_tokens cannot be combined with a grammar (json_schema, regex, ebnf)"
        if not -1 <= req.logprob_start_len < n:
            return f"logprob_start_len ({req.logprob_start_len}) must be -1 or below the prompt length ({n})"
        if n + max_new > self.context_len:
            return (f"prompt ({n} tokens) plus max_new_tokens ({max_new}) exceeds the context "
                    f"length ({self.context_len})")
        if self.cache.pages_for(n + max_new) > self.cache.size:
            return (f"prompt ({n} tokens) plus max_new_tokens ({max_new}) can never fit in the "
                    f"KV pool ({self.cache.size} tokens), even alone")
        return None

    def abort_request(self, rid: str, stop_matched: str | None = None) -> None:
        """Ends `rid` now: aborted by the client, or stopped by the stop string
        the tokenizer process matched in its text."""
        req = self.reqs_by_rid.get(rid)
        if req is None or req.finished:
            return
        if stop_matched is None:
            req.abort("aborted by the client")
        else:  # a stop: its tokens are as good as any finished request's, and cached
            req.finish = FinishMatchedStr(stop_matched)
        self.end_request(req)

    def expire_requests(self, now: float) -> None:
        """Requests past their deadline end as aborts, wherever they are;
        requests still waiting for their first prefill after
        --queue-timeout-ms are refused with a 503."""
        while self.deadlines and self.deadlines[0][0] <= now:
            t, rid = heapq.heappop(self.deadlines)
            req = self.reqs_by_rid.get(rid)
            if req is not None and req.deadline == t and not req.finished:
                req.abort("deadline exceeded")
                self.end_request(req)
        while self.queue_deadlines and self.queue_deadlines[0][0] <= now:
            t, rid = heapq.heappop(self.queue_deadlines)
            req = self.reqs_by_rid.get(rid)
            if req is not None and req.admit_time is None and not req.finished \
                    and t == req.arrival_time + self.args.queue_timeout_ms / 1000:  # not a reused rid
                req.abort("request queue timeout", status_code=QUEUE_FULL_STATUS)
                self.end_request(req)

    def end_request(self, req: Req) -> None:
        """A request that was just given its finish reason out of turn (not by
        a token it sampled) leaves wherever it is, and its client is told."""
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.release_ended(req)
        self.stream_output([req])

    def release_ended(self, req: Req) -> None:
        """A running row keeps its place only until the next filter_batch, and
        its KV is freed now: a step still in flight that writes those slots
        (overlap) runs before any step that could reuse them."""
        self.release_req(req)

    def retire_finished(self, req: Req) -> None:
        """A row that just finished on its token leaves at once."""
        self.release_req(req)

    # ---- choosing the next batch ------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # The rows just prefilled join the running batch, minus those already
        # done and the one still in a chunked prefill.
        # With overlap, the last step's tokens are not known yet: a row whose
        # pending token ends it by length leaves now, one that stops on a stop
        # token leaves a step late (its extra token is thrown away).
        if self.last_batch is not None and self.last_batch.forward_mode is ForwardMode.EXTEND:
            self.last_batch.filter_batch([i for i, r in enumerate(self.last_batch.reqs)
                                          if self.keeps_running(r) and r is not self.chunked_req])
            if not self.last_batch.is_empty():
                if self.running_batch is None:
                    self.running_batch = self.last_batch
                else:
                    self.running_batch.merge_batch(self.last_batch)
            self.last_batch = None  # merged once, even if this is called again before step() ends
        self.filter_running_batch()

        decode_due = self.running_batch is not None and \
            self.num_consecutive_prefill >= self.args.max_consecutive_prefill_batches
        if not decode_due:
            new_batch = self.get_new_batch_prefill()
            if new_batch is not None:
                # only prefills that make running rows wait count towards the bound
                if self.running_batch is not None and not self.mix_running_into(new_batch):
                    self.num_consecutive_prefill += 1
                self.cache_prefill(new_batch)
                return new_batch
        self.num_consecutive_prefill = 0
        if self.running_batch is None:
            if not self.waiting_queue and self.chunked_req is None:
                self.new_token_ratio = self.init_new_token_ratio  # idle: reset
            return None
        return self.update_running_batch()

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

    def mix_running_into(self, batch: ScheduleBatch) -> bool:
        """--enable-mixed-chunk: the running rows take their decode step inside
        this prefill step (SGLang's mixed chunk): one pass over the weights
        for both, and no running row waits for the prefill. They come back as
        running rows when the step's rows are merged (get_next_batch_to_run).
        Not when the pool lacks a slot per row: then they wait, and their own
        decode step retracts as usual."""
        running = self.running_batch
        if not self.args.enable_mixed_chunk or running is None \
                or self.cache.available() < self.cache.decode_slots(running.reqs):
            return False
        running.prepare_for_decode(self.cache)
        batch.mix_with_running(running)
        self.running_batch = None
        self.num_mixed_steps += 1
        return True

    def keeps_running(self, req: Req) -> bool:
        return not req.finished and not req.finishes_with_pending(self.context_len)

    def filter_running_batch(self) -> None:
        batch = self.running_batch
        if batch is not None:
            batch.filter_batch([i for i, r in enumerate(batch.reqs) if self.keeps_running(r)])
            if batch.is_empty():
                self.running_batch = None

    def get_new_batch_prefill(self, after_preemption: bool = False) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs if self.running_batch is not None else []
        # With overlap, rows that finish in the step in flight have left the running
        # batch but hold their table row (and KV) until its result is processed.
        pool = self.cache.req_to_token_pool
        held = pool.num_rows - pool.available()
        leaving = held - len(running) - (1 if self.chunked_req is not None
                                         and self.chunked_req.req_pool_idx else 0)
        adder = PrefillAdder.for_step(
            max_running=self.args.max_running_requests - leaving, running=running,
            free_slots=self.cache.available(), page_size=self.cache.page_size,
            max_prefill_tokens=self.args.max_prefill_tokens,
            chunked_prefill_size=self.args.chunked_prefill_size,
            new_token_ratio=self.new_token_ratio)
        if self.chunked_req is not None:
            # leave every running row room for its next decode step
            adder.add_chunked_req(self.chunked_req, self.cache.available() - self.cache.decode_slots(running))
            if not adder.can_run:
                return None
        self.waiting_queue = order_waiting_queue(
            self.waiting_queue, self.args.schedule_policy, self.cache.cached_len if self.cache.tree else None,
            by_priority=self.args.enable_priority_scheduling,
            low_priority_first=self.args.schedule_low_priority_values_first)
        # what this batch computes, as a tree of its own: a request that would
        # compute the same prefix again waits one batch and then takes it from
        # the cache (SGLang's in-batch prefix check, for every policy here)
        in_batch = RadixCache(lambda slots: None) if self.cache.tree is not None else None
        if in_batch is not None and self.chunked_req is not None:
            self._computed_in_batch(in_batch, self.chunked_req)
        admitted: set[int] = set()
        blocked: Req | None = None  # the first request that did not fit
        for req in self.waiting_queue:
            match = self.cache.match(req)
            cached = match.length if match else 0
            if in_batch is not None and cached + IN_BATCH_PREFIX_MIN <= in_batch.match_prefix(
                    req.fill_ids[:req.prefix_limit], req.cache_salt).length:
                continue
            if not adder.try_add(req, prefix_len=cached,
                                 newly_protected=self.cache.newly_protected(match)):
                blocked = req
                break
            self.cache.admit(req, match)  # its row, and its prefix locked in the tree
            admitted.add(id(req))
            if in_batch is not None:
                self._computed_in_batch(in_batch, req)
        if not adder.can_run:
            if blocked is not None and self.args.priority_preemption and self.chunked_req is None \
                    and not after_preemption and self.preempt_for(blocked):
                return self.get_new_batch_prefill(after_preemption=True)  # now it fits
            return None
        self.waiting_queue = deque(r for r in self.waiting_queue if id(r) not in admitted)
        continuing = self.chunked_req
        if continuing is not None and adder.new_chunked_req is None:
            logger.debug("chunked prefill of %s: last chunk", continuing.rid)
        self.chunked_req = adder.new_chunked_req
        return self.start_prefill(adder.can_run, len(running), continuing)

    @staticmethod
    def _computed_in_batch(in_batch: RadixCache, req: Req) -> None:
        n = req.kv_len + req.extend_input_len
        in_batch.insert(req.fill_ids[:n], torch.zeros(n, dtype=torch.int64), req.cache_salt)

    def start_prefill(self, reqs: list[Req], num_running: int,
                      continuing: Req | None = None) -> ScheduleBatch:
        """`continuing`: the request whose next chunk this is (not admitted now)."""
        now = time.time()
        hit_tokens = 0  # taken from the prefix cache by the requests admitted now
        for r in reqs:
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
            self.timeline.request(r.rid, event, t=now, tokens=r.extend_input_len
                                  or r.seq_len - r.kv_len, cached_tokens=hit)
        batch = ScheduleBatch.init_new(reqs)
        batch.prepare_for_extend(self.cache)
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch), batch.input_ids.numel(), hit_tokens, self.token_usage(),
            num_running, len(self.waiting_queue))
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        """Make room for one more token per row (retracting if the pool is short),
        then prepare the decode step."""
        batch = self.running_batch
        assert batch is not None
        if self.cache.available() < self.cache.decode_slots(batch.reqs) and self.inflight:
            # Short of slots with a step in flight: first see its result (its
            # finished rows free their KV); victims must have all their tokens.
            self.resolve_inflight()
            self.filter_running_batch()
            batch = self.running_batch
            if batch is None:  # every row finished: look again (a prefill may fit now)
                return self.get_next_batch_to_run()
        if self.cache.available() < self.cache.decode_slots(batch.reqs):
            self.retract_decode(batch)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay,
                                       self.min_new_token_ratio)
        batch.prepare_for_decode(self.cache)
        return batch

    def retract_decode(self, batch: ScheduleBatch) -> None:
        """Free the KV of victims (fewest decoded tokens first, ties to the longest
        prompt) until every remaining row can get a slot; victims go back to the
        front of the queue with their tokens, to be recomputed when re-admitted.
        No step may be in flight: a victim's pending token would be lost."""
        assert not self.inflight, "retract_decode with a step in flight"
        order = sorted(range(len(batch)), key=lambda i: (len(batch.reqs[i].output_ids),
                                                          -len(batch.reqs[i].origin_input_ids)))
        retracted: list[Req] = []
        keep = set(range(len(batch)))
        def fits() -> bool:
            return self.cache.available() >= self.cache.decode_slots([batch.reqs[k] for k in keep])
        for i in order:
            if fits():
                break
            if len(keep) == 1 and self.chunked_req is not None:
                # the half-prefilled request holds the slots: it goes back instead
                self.retract(self.chunked_req)
                retracted.append(self.chunked_req)
                self.chunked_req = None
                if fits():
                    break
            if len(keep) == 1:  # cannot happen after validate(); never loop forever
                req = batch.reqs[i]
                req.abort(f"the KV pool ({self.cache.size} tokens) cannot hold this request")
                self.release_req(req)
                self.stream_output([req])
                keep.discard(i)
                break
            req = batch.reqs[i]
            self.retract(req)
            retracted.append(req)
            keep.discard(i)
        batch.filter_batch(sorted(keep))
        for req in reversed(retracted):  # the first victim ends up first in the queue
            self.waiting_queue.appendleft(req)
        self.total_retractions += len(retracted)

        old_ratio = self.new_token_ratio
        if batch.reqs:
            decoded = sum(len(r.output_ids) for r in batch.reqs)
            max_new = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
            self.new_token_ratio = min(
                1.0, (decoded + RETRACT_DECODE_STEPS * len(batch.reqs)) / max(max_new, 1))
            self.new_token_ratio = max(self.new_token_ratio, old_ratio)
        logger.info("KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                    "#new_token_ratio: %.4f -> %.4f", len(retracted), old_ratio,
                    self.new_token_ratio)

    def retract(self, req: Req) -> None:
        """Free a request's KV; it keeps its tokens and is recomputed when
        admitted again. The caller puts it back in the waiting queue."""
        self.release_req(req, retracting=True)
        req.num_retractions += 1
        req.waiting_since = time.time()
        self.timeline.request(req.rid, "retracted", decoded=len(req.output_ids))

    def outranks(self, a: Req, b: Req) -> bool:
        """a has strictly higher priority than b."""
        return a.priority < b.priority if self.args.schedule_low_priority_values_first else a.priority > b.priority

    def preempt_for(self, blocked: Req) -> bool:
        """--priority-preemption: `blocked` (the first waiting request, which
        does not fit) retracts running requests of strictly lower priority,
        lowest first (then least decoded), until it would fit. They resume
        from the queue, as after any retraction."""
        running = self.running_batch.reqs if self.running_batch is not None else []
        if not any(self.outranks(blocked, r) for r in running):
            return False
        if self.inflight:  # a victim's pending token would be lost
            self.resolve_inflight()
            self.filter_running_batch()
        sign = -1 if self.args.schedule_low_priority_values_first else 1  # lowest priority first
        victims = sorted((r for r in (self.running_batch.reqs if self.running_batch else [])
                          if self.outranks(blocked, r)),
                         key=lambda r: (sign * r.priority, len(r.output_ids), -len(r.origin_input_ids)))
        retracted: list[Req] = []
        for victim in victims:
            if self.would_admit(blocked):
                break
            self.retract(victim)
            retracted.append(victim)
            self.running_batch.filter_batch([i for i, r in enumerate(self.running_batch.reqs) if r is not victim])
        if self.running_batch is not None and self.running_batch.is_empty():
            self.running_batch = None
        self.waiting_queue.extend(retracted)  # the queue is ordered by priority before each admission
        self.total_retractions += len(retracted)
        if retracted:
            logger.info("Priority preemption: %d running request(s) of lower priority retracted for %s "
                        "(priority %d)", len(retracted), blocked.rid, blocked.priority)
        return bool(retracted)

    def would_admit(self, req: Req) -> bool:
        """Whether a prefill built now would admit `req` first (no step in flight)."""
        running = self.running_batch.reqs if self.running_batch is not None else []
        adder = PrefillAdder.for_step(
            max_running=self.args.max_running_requests, running=running, free_slots=self.cache.available(),
            page_size=self.cache.page_size, max_prefill_tokens=self.args.max_prefill_tokens, chunked_prefill_size=self.args.chunked_prefill_size,
            new_token_ratio=self.new_token_ratio)
        match = self.cache.match(req)
        fits = adder.try_add(req, prefix_len=match.length if match else 0,
                             newly_protected=self.cache.newly_protected(match))
        req.extend_input_len = 0  # a dry run
        return fits

    # ---- running it -------------------------------------------------------------------

    def launch_batch(self, batch: ScheduleBatch) -> None:
        """Send the step to the model; its result is processed by resolve_oldest."""
        fb = batch.to_forward_batch()
        # a row whose prompt is not all in the pool yet samples nothing it keeps
        produces = [batch.keeps_token(i, s) for i, s in enumerate(fb.seq_lens)]
        for r, p in zip(batch.reqs, produces):
            r.pending_tokens += p
        self.model.send(fb)
        self.inflight.append(LaunchedStep(batch.forward_mode, list(batch.reqs), produces,
                                          len(fb.out_cache_loc), time.perf_counter(),
                                          fb.input_logprob_rows, bool(fb.grammar_rows),
                                          len(batch) - batch.decode_from))

    def resolve_oldest(self) -> None:
        step = self.inflight.popleft()
        result = self.model.recv()
        now = time.perf_counter()
        # the model's share of the wall time: from launch, or from the previous
        # result when this step queued behind it
        step_time = now - max(step.launch_time, self.last_result_time)
        self.last_result_time = now
        self.process_batch_result(step, result)
        self.timeline.step(kind=step.forward_mode.value, batch_size=len(step.reqs),
                           tokens=step.num_tokens, kv_usage=self.token_usage(),
                           step_time=step_time)

    def resolve_inflight(self) -> None:
        while self.inflight:
            self.resolve_oldest()

    def process_batch_result(self, step: LaunchedStep, result: ForwardResult) -> None:
        for j, row in enumerate(step.input_logprob_rows):
            req = step.reqs[row]
            req.input_token_logprobs.extend(result.input_token_logprobs[j])
            if req.top_logprobs_num:
                req.input_top_logprobs.extend(
                    list(zip(v, i)) for v, i in zip(result.input_top_logprob_vals[j],
                                                    result.input_top_logprob_ids[j]))
        for i, (req, produces, token) in enumerate(zip(step.reqs, step.produces,
                                                       result.next_token_ids)):
            if not produces:  # a chunk of a longer prompt: no token yet
                continue
            req.pending_tokens -= 1
            if req.finished:
                # computed and thrown away: a row that stopped one step earlier
                # (overlap) or was aborted while the step ran (not padding), or
                # a padded batch's finished row (counted: padded_row_steps)
                self.total_row_steps += self.padded_row_steps
                continue
            self.total_row_steps += 1
            self.useful_row_steps += 1
            req.output_ids.append(token)
            if req.grammar is not None and not req.grammar.accept(token):
                # the step's mask allows only what the matcher accepts: a bug
                logger.error("request %s: the grammar rejected sampled token %d", req.rid, token)
                req.abort("internal error: the grammar rejected a sampled token")
            if not req.first_token_time:
                req.first_token_time = time.time()
                self.timeline.request(req.rid, "first_token", t=req.first_token_time)
            if req.return_logprob:
                req.output_token_logprobs.append(result.next_token_logprobs[i])
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(
                        list(zip(result.top_logprob_vals[i], result.top_logprob_ids[i])))
            if not req.finished:
                req.check_finished(self.context_len)
            if req.finished:
                self.retire_finished(req)
        decoded = step.num_decode_rows
        if decoded:
            self.num_decode_steps += 1
            self.decode_tokens_since_log += decoded
            if self.num_decode_steps % DECODE_LOG_INTERVAL == 0:
                self.log_decode_stats(decoded)
        self.stream_output(step.reqs)

    def release_req(self, req: Req, retracting: bool = False) -> None:
        """Give back a request's KV slots and table row; a request that finished
        (not aborted, not retracted) leaves its prompt and output in the prefix
        cache. Unless it is only being retracted, it also leaves the set of live
        requests."""
        finished = req.finished and not req.aborted
        self.cache.release(req, cache=finished and not retracting)
        req.penalty_state_sent = False  # its next row gets its state rebuilt at its extend
        if not retracting:
            self.reqs_by_rid.pop(req.rid, None)

    # ---- output -----------------------------------------------------------------------

    def stream_output(self, reqs: list[Req]) -> None:
        """Send new tokens: streaming rows every stream_interval tokens, the rest
        when they finish. Every request gets exactly one final row."""
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
                interval = req.sampling_params.stream_interval or self.args.stream_interval
                if req.sent_len > 0 and pending < interval:
                    continue
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[req.sent_len:])
            out.finished_reasons.append(req.finished_reason)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.num_retractions.append(req.num_retractions)
            out.output_token_logprobs.append(req.output_token_logprobs[req.sent_len:])
            out.output_top_logprobs.append(req.output_top_logprobs[req.sent_len:])
            self.add_input_logprobs(out, req)
            out.queue_times.append(req.queue_time)
            out.first_token_times.append(req.first_token_time)
            req.sent_len = len(req.output_ids)
            req.finish_sent = req.finished
            if req.finished:
                self.timeline.request(req.rid, "finished", reason=req.finished_reason["type"],
                                      completion_tokens=len(req.output_ids))
        if out.rids:
            self.send_output(out)

    @staticmethod
    def add_input_logprobs(out: BatchTokenOut, req: Req) -> None:
        """A request's prompt logprobs go in its first message, in SGLang's
        layout: one entry per prompt token from logprob_start_len, the first None."""
        if req.logprob_start_len < 0 or req.input_logprobs_sent:
            out.input_token_logprobs.append([])
            out.input_top_logprobs.append([])
            return
        out.input_token_logprobs.append([None, *req.input_token_logprobs])
        out.input_top_logprobs.append([None, *req.input_top_logprobs] if req.top_logprobs_num else [])
        req.input_logprobs_sent = True

    # ---- loop ---------------------------------------------------------------------------

    def step(self) -> ScheduleBatch | None:
        """One iteration after input was processed: pick a batch, send it, retire rows.

        Plain loop: send step t, then read and process its result. Overlap: send
        step t+1, then read and process step t's result while the model runs
        t+1, so the scheduler's own work hides behind the forward. With nothing
        new to send, every result still out is processed."""
        self.expire_requests(time.time())
        self.move_compiled_grammar_reqs()
        if any(step.samples_constrained for step in self.inflight):
            # a constrained row's next mask needs the token in flight: this
            # step runs without overlap (see scheduler_proc/grammar.py)
            self.resolve_inflight()
        batch = self.get_next_batch_to_run()
        if batch is None and self.inflight:
            # nothing to send until the step out is processed (its finished rows
            # give back their KV and table rows): catch up, then look again
            self.resolve_inflight()
            batch = self.get_next_batch_to_run()
        if batch is not None:
            self.launch_batch(batch)
        keep_in_flight = 1 if self.overlap and batch is not None else 0
        while len(self.inflight) > keep_in_flight:
            self.resolve_oldest()
        self.last_batch = batch
        return batch

    def check_invariant(self) -> None:
        """Every KV slot and table row accounted for exactly once (checked when
        the server goes idle; an error is logged and shown in /get_server_info)."""
        error = self.cache.check_invariant()
        if error is not None and error != self.invariant_error:
            logger.error("KV cache accounts are off: %s", error)
        self.invariant_error = error

    def is_idle(self) -> bool:
        return not self.waiting_queue and not self.grammar_queue and self.running_batch is None and \
            self.chunked_req is None and not self.inflight and \
            (self.last_batch is None or self.last_batch.forward_mode is not ForwardMode.EXTEND)

    def event_loop(self, recv_requests: Callable[[float | None], list[ToSchedulerMsg]]) -> None:
        """`recv_requests(timeout_s)` drains the input socket, first waiting up to
        timeout_s (None: until something comes) for a message."""
        ran = True
        while True:
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

    # ---- stats --------------------------------------------------------------------------

    def token_usage(self) -> float:
        """Share of the pool held by requests (cached but evictable slots are free)."""
        return 1.0 - self.cache.available() / self.cache.size

    def utilisation(self) -> float:
        """Useful row-steps over computed row-steps: 1.0 unless padded rows ran."""
        return self.useful_row_steps / self.total_row_steps if self.total_row_steps else 1.0

    def state(self) -> dict[str, Any]:
        return {
            "max_running_requests": self.args.max_running_requests,
            "batching": self.args.batching,
            "num_running_reqs": len(self.running_batch) if self.running_batch else 0,
            "num_waiting_reqs": len(self.waiting_queue),
            "num_grammar_queue_reqs": len(self.grammar_queue),
            "max_queued_requests": self.max_queued_requests,  # waiting for their grammar to compile
            # admitted, part of its prompt in the pool, the rest still to prefill:
            # neither in the running batch nor waiting
            "num_chunked_prefill_reqs": 0 if self.chunked_req is None else 1,
            **self.cache.stats(),
            "radix_cache": self.radix_cache_enabled,
            "invariant_error": self.invariant_error,
            "token_usage": self.token_usage(),
            "new_token_ratio": self.new_token_ratio,
            "total_retractions": self.total_retractions,
            "enable_mixed_chunk": self.args.enable_mixed_chunk,
            "num_mixed_steps": self.num_mixed_steps,
            "batch_utilisation": self.utilisation(),
            "useful_row_steps": self.useful_row_steps,
            "total_row_steps": self.total_row_steps,
        }

    def log_decode_stats(self, running: int) -> None:
        """`running`: the rows of the decode step just finished (with overlap the
        running batch may already have lost rows that ended in it)."""
        now = time.perf_counter()
        throughput = self.decode_tokens_since_log / max(now - self.last_decode_log_time, 1e-9)
        num_tokens = self.cache.size - self.cache.available()
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, batch utilisation: %.3f",
            running, num_tokens,
            self.token_usage(), throughput, len(self.waiting_queue), self.utilisation())
        self.last_decode_log_time = now
        self.decode_tokens_since_log = 0
