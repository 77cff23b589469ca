"""RequestQueue: requests from arrival to admission, and the index of every
live request (intake, the grammar wait, time bounds, the end of a rid)."""

from __future__ import annotations

import heapq
import logging
from collections import deque
from typing import Callable

from common.messages import AbortKind, ModelInfo, TokenizedGenerateReq
from common.sampling_rules import sampling_error, token_ids_logprob_error
from common.server_args import ServerArgs
from scheduler_proc.grammar import GrammarBackend, GrammarFailure, ReqGrammar
from scheduler_proc.req import Req

logger = logging.getLogger(__name__)


def default_queue_limit(max_running_requests: int, pool_tokens: int) -> int:
    """Waiting requests allowed without --max-queued-requests: enough to refill
    the running batch 8 times, or to fill the KV pool with 64-token requests,
    and never fewer than 128. A bounded queue turns overload into quick
    refusals instead of unbounded memory and waits."""
    return max(128, 8 * max_running_requests, pool_tokens // 64)


class RequestQueue:
    """`waiting`: ready to be admitted (the prefill manager orders it);
    `grammar_wait`: their grammar still compiling; `by_rid`: every request
    not yet finished, wherever it is."""

    def __init__(self, args: ServerArgs, model_info: ModelInfo, pool_size: int,
                 pages_for: Callable[[int], int]) -> None:
        self.args = args
        self.model_info = model_info
        self.pool_size = pool_size
        self.pages_for = pages_for
        self.max_queued = args.max_queued_requests if args.max_queued_requests is not None \
            else default_queue_limit(args.max_running_requests, model_info.max_total_tokens)
        self.waiting: deque[Req] = deque()
        self.grammar_wait: list[Req] = []
        self.grammar_backend = GrammarBackend(model_info.tokenizer_path, model_info.vocab_size,
                                              model_info.eos_token_ids, args)
        self.by_rid: dict[str, Req] = {}
        # time bounds, earliest first: (time.time(), rid); an entry whose
        # request finished (or whose rid was reused) is dropped when it comes up
        self.deadlines: list[tuple[float, str]] = []
        self.queue_deadlines: list[tuple[float, str]] = []  # --queue-timeout-ms

    def __len__(self) -> int:
        """Requests waiting, for their grammar or for admission."""
        return len(self.waiting) + len(self.grammar_wait)

    @property
    def num_admitted(self) -> int:
        """Live requests past admission, wherever the step loop holds them (the
        running batch, a prefill step in flight, a chunked prefill)."""
        return len(self.by_rid) - len(self)

    def add(self, msg: TokenizedGenerateReq) -> Req | None:
        """The request for `msg`, queued; or refused (returned finished, for
        the caller to answer); None: dropped, its rid is live already."""
        req = Req.from_message(msg, self.model_info.eos_token_ids, self.model_info.vocab_size)
        if msg.rid in self.by_rid:
            # The tokenizer process refuses duplicates; answering this one would
            # finish the request that owns the rid.
            logger.error("dropping request with duplicate rid %r", msg.rid)
            return None
        error = self.validate(req)
        if error is not None:
            req.abort(AbortKind.INVALID, error)
        elif len(self) >= self.max_queued:
            req.abort(AbortKind.QUEUE_FULL, f"the queue is full ({self.max_queued} requests waiting)")
        if req.finished:
            return req
        self.by_rid[req.rid] = req
        timeout = msg.timeout_s if msg.timeout_s is not None else self.args.request_timeout_s
        if timeout is not None:
            req.deadline = req.arrival_time + timeout
            heapq.heappush(self.deadlines, (req.deadline, req.rid))
        if self.args.queue_timeout_ms is not None:
            heapq.heappush(self.queue_deadlines, (req.arrival_time + self.args.queue_timeout_ms / 1000, req.rid))
        if req.sampling_params.grammar is not None:
            req.grammar_future = self.grammar_backend.compile(req.sampling_params.grammar)
            self.grammar_wait.append(req)
        else:
            self.waiting.append(req)
        return req

    def validate(self, req: Req) -> str | None:
        """The tokenizer process already checks these; a scheduler never trusts a
        peer: out-of-range values would overflow the batch's int64 tensors and
        stop the loop."""
        n = len(req.origin_input_ids)
        max_new = req.sampling_params.max_new_tokens
        vocab = self.model_info.vocab_size
        if n == 0:
            return "the prompt is empty"
        if not all(0 <= t < vocab for t in req.origin_input_ids):
            return f"token ids must be in [0, {vocab})"
        error = sampling_error(req.sampling_params, vocab) or token_ids_logprob_error(req.token_ids_logprob, vocab)
        if error is not None:
            return error
        if req.thinking is not None:
            error = req.thinking.error(vocab, req.sampling_params.grammar is not None)
            if error is not None:
                return error
        if not -1 <= req.logprob_start_len < n:
            return f"logprob_start_len ({req.logprob_start_len}) must be -1 or below the prompt length ({n})"
        context_len = self.model_info.context_len
        if n + max_new > context_len:
            return (f"prompt ({n} tokens) plus max_new_tokens ({max_new}) exceeds the context "
                    f"length ({context_len})")
        if self.pages_for(n + max_new) > self.pool_size:
            return (f"prompt ({n} tokens) plus max_new_tokens ({max_new}) can never fit in the "
                    f"KV pool ({self.pool_size} tokens), even alone")
        return None

    def take_compiled(self) -> list[Req]:
        """Requests whose grammar compiled join the waiting queue, in arrival
        order; those whose grammar failed are returned, refused, to be ended."""
        failed: list[Req] = []
        still: list[Req] = []
        for req in self.grammar_wait:
            outcome = self.grammar_backend.outcome(req.grammar_future)
            if outcome is None:
                still.append(req)
                continue
            req.grammar_future = None
            if isinstance(outcome, GrammarFailure):  # does not compile, or not within the budget
                req.abort(AbortKind.INVALID, outcome.message)
                failed.append(req)
                continue
            req.grammar = ReqGrammar(outcome)
            self.waiting.append(req)
        self.grammar_wait = still
        return failed

    def expired(self, now: float) -> list[Req]:
        """Requests past their deadline, given their abort: wherever they are;
        and those still waiting for their first prefill after
        --queue-timeout-ms (as if the queue were full). The caller ends them."""
        out: list[Req] = []
        while self.deadlines and self.deadlines[0][0] <= now:
            t, rid = heapq.heappop(self.deadlines)
            req = self.by_rid.get(rid)
            if req is not None and req.deadline == t and not req.finished:
                req.abort(AbortKind.DEADLINE, "deadline exceeded")
                out.append(req)
        while self.queue_deadlines and self.queue_deadlines[0][0] <= now:
            t, rid = heapq.heappop(self.queue_deadlines)
            req = self.by_rid.get(rid)
            if req is not None and req.admit_time is None and not req.finished \
                    and t == req.arrival_time + self.args.queue_timeout_ms / 1000:  # not a reused rid
                req.abort(AbortKind.QUEUE_FULL, "request queue timeout")
                out.append(req)
        return out

    def remove(self, req: Req) -> None:
        """Out of whichever queue holds it (it was ended before admission)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.grammar_wait:
            self.grammar_wait.remove(req)
            self.grammar_backend.release(req.grammar_future)  # a compile nobody waits for is dropped
            req.grammar_future = None

    def forget(self, req: Req) -> None:
        """Its rid is free for reuse."""
        self.by_rid.pop(req.rid, None)
