"""OutputProcessor: the one place a step's results are read, and the one place
tokens are streamed to the tokenizer process."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from common.messages import AbortKind, BatchTokenOut, FinishLength, ForwardMode, ForwardResult, ToTokenizerMsg
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.req import Req
from scheduler_proc.speculative.policy import Speculator
from scheduler_proc.timeline import Timeline

# "Decode batch." log lines go to the scheduler's logger, where operators grep them
logger = logging.getLogger("scheduler_proc.scheduler")

DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch." log lines, as SGLang


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
    # the next step needs this one's tokens: a grammar's next mask, a spent
    # thinking budget's forced token, or a verify's kept tokens (the rows' lengths)
    next_needs_result: bool
    num_decode_rows: int  # rows decoding one token (all of a decode step, the running rows of a mixed one)
    draft_lens: list[int] = field(default_factory=list)  # VERIFY: each row's drafts


class OutputProcessor:
    """`retire(req)` is called for a row that finished on the token it just
    sampled; `padded_row_steps`: whether a finished row still computed counts
    as a row-step (padding, in the padded baselines)."""

    def __init__(self, context_len: int, stream_interval: int, cache: CacheManager, timeline: Timeline,
                 send_output: Callable[[ToTokenizerMsg], None], retire: Callable[[Req], None],
                 padded_row_steps: int, speculator: Speculator | None = None) -> None:
        self.context_len = context_len
        self.speculator = speculator
        self.stream_interval = stream_interval
        self.cache = cache
        self.timeline = timeline
        self.send_output = send_output
        self.retire = retire
        self.padded_row_steps = padded_row_steps
        self.num_decode_steps = 0
        self.useful_row_steps = 0  # rows whose step produced a token that was kept
        self.total_row_steps = 0  # rows computed (static batching also computes finished ones)
        self.decode_tokens_since_log = 0
        self.last_decode_log_time = time.perf_counter()

    def process(self, step: LaunchedStep, result: ForwardResult, num_waiting: int) -> None:
        for j, row in enumerate(step.input_logprob_rows):
            req = step.reqs[row]
            req.input_token_logprobs.extend(result.input_token_logprobs[j])
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.extend(result.input_token_ids_logprobs[j])
            if req.top_logprobs_num:
                req.input_top_logprobs.extend(
                    list(zip(v, i)) for v, i in zip(result.input_top_logprob_vals[j],
                                                    result.input_top_logprob_ids[j]))
        if step.forward_mode is ForwardMode.VERIFY:
            self.process_verify(step, result)
        else:
            self.process_rows(step, result)
        if step.num_decode_rows:
            self.num_decode_steps += 1
            # a verify step's rows each keep one token or more
            self.decode_tokens_since_log += sum(result.accept_lens) if result.accept_lens else step.num_decode_rows
            if self.num_decode_steps % DECODE_LOG_INTERVAL == 0:
                self.log_decode_stats(step.num_decode_rows, num_waiting)
        if self.speculator is not None and step.forward_mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
            self.speculator.observe_step(step.forward_mode is ForwardMode.VERIFY, len(step.reqs), step.num_tokens,
                                         result.forward_time)
        self.stream(step.reqs)

    def process_rows(self, step: LaunchedStep, result: ForwardResult) -> None:
        """A token per row (DECODE, EXTEND, MIXED)."""
        for i, (req, produces, token) in enumerate(zip(step.reqs, step.produces, result.next_token_ids)):
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
            if req.prefill_only:
                # its prompt is in the pool now (and its prompt logprobs taken):
                # the token sampled after it is no output of a 0-token request
                req.finish = FinishLength(0)
                self.retire(req)
                continue
            self.append_token(req, i, token, result)
            if req.finished:
                self.retire(req)

    def process_verify(self, step: LaunchedStep, result: ForwardResult) -> None:
        """Each row keeps result.accept_lens[i] of its sampled tokens (its
        agreed drafts, then the sample after them): its KV past them goes back
        first, then the tokens are appended one by one, up to the one that
        finishes it (the rest are dropped, never streamed)."""
        assert self.speculator is not None
        start = 0
        for req, drafted, kept in zip(step.reqs, step.draft_lens, result.accept_lens):
            first, start = start, start + 1 + drafted
            req.pending_tokens -= 1
            self.total_row_steps += 1
            if req.finished:  # aborted or stopped while the step ran: its KV is back already
                continue
            self.useful_row_steps += 1
            self.cache.trim(req, req.kv_len - (1 + drafted - kept))
            self.speculator.record(req, drafted, kept - 1)
            for j in range(first, first + kept):
                self.append_token(req, j, result.next_token_ids[j], result)
                if req.finished:
                    self.retire(req)
                    break
        self.speculator.stats.verify_steps += 1

    def append_token(self, req: Req, row: int, token: int, result: ForwardResult) -> None:
        req.output_ids.append(token)
        if req.grammar is not None and not req.grammar.accept(token):
            # the step's mask allows only what the matcher accepts: a bug
            logger.error("request %s: the grammar rejected sampled token %d", req.rid, token)
            req.abort(AbortKind.SERVER_ERROR, "internal error: the grammar rejected a sampled token")
        if req.thinking is not None:
            req.thinking.accept(req.output_ids)
        if not req.first_token_time:
            req.first_token_time = time.time()
            self.timeline.request(req.rid, "first_token", t=req.first_token_time)
        if req.return_logprob:
            req.output_token_logprobs.append(result.next_token_logprobs[row])
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(result.token_ids_logprobs[row])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(
                    list(zip(result.top_logprob_vals[row], result.top_logprob_ids[row])))
        if not req.finished:
            req.check_finished(self.context_len)

    def stream(self, reqs: list[Req]) -> None:
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
                interval = req.sampling_params.stream_interval or self.stream_interval
                if req.sent_len > 0 and pending < interval:
                    continue
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[req.sent_len:])
            out.finished_reasons.append(req.finish)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cache_hit_tokens)
            out.num_retractions.append(req.num_retractions)
            out.output_token_logprobs.append(req.output_token_logprobs[req.sent_len:])
            out.output_top_logprobs.append(req.output_top_logprobs[req.sent_len:])
            out.output_token_ids_logprobs.append(req.output_token_ids_logprobs[req.sent_len:])
            self.add_input_logprobs(out, req)
            out.queue_times.append(req.queue_time)
            out.first_token_times.append(req.first_token_time)
            if self.speculator is not None:
                state = req.draft_state
                out.spec_verify_ct.append(state.verify_ct if state is not None else 0)
                out.spec_accepted_tokens.append(state.accepted if state is not None else 0)
            req.sent_len = len(req.output_ids)
            req.finish_sent = req.finished
            if req.finished:
                self.timeline.request(req.rid, "finished", reason=req.finish.type,
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
            out.input_token_ids_logprobs.append([])
            return
        out.input_token_logprobs.append([None, *req.input_token_logprobs])
        out.input_top_logprobs.append([None, *req.input_top_logprobs] if req.top_logprobs_num else [])
        out.input_token_ids_logprobs.append([None, *req.input_token_ids_logprobs] if req.token_ids_logprob else [])
        req.input_logprobs_sent = True

    # ---- stats --------------------------------------------------------------------------

    def utilisation(self) -> float:
        """Useful row-steps over computed row-steps: 1.0 unless padded rows ran."""
        return self.useful_row_steps / self.total_row_steps if self.total_row_steps else 1.0

    def log_decode_stats(self, running: int, num_waiting: int) -> None:
        """`running`: the rows of the decode step just finished (with overlap the
        running batch may already have lost rows that ended in it)."""
        now = time.perf_counter()
        throughput = self.decode_tokens_since_log / max(now - self.last_decode_log_time, 1e-9)
        num_tokens = self.cache.size - self.cache.available()
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, batch utilisation: %.3f",
            running, num_tokens, self.cache.token_usage(), throughput, num_waiting, self.utilisation())
        self.last_decode_log_time = now
        self.decode_tokens_since_log = 0
