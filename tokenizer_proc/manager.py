"""The tokenizer process's side of the scheduler link.

Requests go out over a PUSH socket; one background task reads every
`BatchTokenOut` from the PULL socket and hands each row to its request's
`ReqState`, waking the HTTP handler that waits on it. A request stays
registered until the scheduler sends its final row (finished or aborted), so
a rid is never reused while the scheduler still holds it.

Several requests may share one wake-up event: an HTTP request that fans out
(n samples, a list of prompts) then sleeps on one event for all of them.

Questions for the scheduler (`query_scheduler`: its live state, a cache
flush, its timeline) go over the same sockets and are matched to their
replies by id.

The front end does not trust the engine to be alive: every message from the
scheduler (its heartbeats come every half second, idle or busy) is noted, so
/health and the watchdog can tell a silent scheduler, or a model that stopped
answering the scheduler, from a healthy one (`unresponsive`, `hung`); and a
request's deadline (`timeout`, --request-timeout-s) is kept here too, so a
client gets its answer at its deadline even when the scheduler cannot act.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.ipc import AsyncPullSocket, PushSocket
from common.messages import (AbortKind, AbortReq, BatchTokenOut, FinishAbort, FinishReason, FlushCacheQuery, IpcPaths,
                             SchedulerHeartbeat, SchedulerReply, StateQuery, StopMatchedReq, TimelineQuery,
                             TokenizedGenerateReq, ToTokenizerMsg)
from common.server_args import ServerArgs
from tokenizer_proc.errors import ServiceUnavailableError
from tokenizer_proc.metrics import ServerMetrics

logger = logging.getLogger(__name__)

ABORT_RETRY_S = 0.01  # an abort the scheduler's full queue refused is tried again this often
# The front end ends a request this long after its deadline if the engine is
# silent; the scheduler's own answer (its tokens, its KV freed) normally comes
# first, and an engine that answers gets up to DEADLINE_MAX_GRACE_S to send it
# (a long step may hold its deadline check).
DEADLINE_GRACE_S = 0.1
DEADLINE_MAX_GRACE_S = 2.0
DEADLINE_RECHECK_S = 0.1
ANSWERING_WITHIN_S = 1.0  # heard from within this, the model owing no older step: the engine answers
DEADLINE_EXCEEDED = "deadline exceeded"  # the scheduler's words for the same finish


@dataclass
class ReqState:
    """What the scheduler sent for one request, as it sent it. What the client
    sees (text, stop strings cut) is `request_output.RequestOutput`."""

    rid: str
    prompt_tokens: int
    arrival: float  # time.perf_counter() when the HTTP request came in
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    # speculative decoding (None: the server does not speculate): verify steps, drafts kept
    spec: tuple[int, int] | None = None
    queue_time: float = 0.0  # seconds from arrival at the scheduler to its first prefill
    arrival_wall: float = 0.0  # time.time() at arrival, for latency metrics
    first_token_wall: float = 0.0  # time.time() of the first output token (scheduler's clock)
    abort_sent: bool = False
    # The HTTP request this one belongs to (its id), when it fanned out into
    # several; /abort_request with that id aborts them all.
    group: str | None = None
    # One entry per output token, filled when the request asked for logprobs.
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Prompt logprobs (logprob_start_len >= 0), from the first message: one entry
    # per prompt token from logprob_start_len, the first None (SGLang's layout)
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # token_ids_logprob's values, aligned with token_logprobs and input_token_logprobs
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float] | None] = field(default_factory=list)
    # Set whenever new output arrives; the handler clears it after reading.
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # the front end's own deadline for it (None: no timeout)
    deadline_timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class DuplicateRidError(Exception):
    pass


class TokenizerManager:
    def __init__(self, ipc: IpcPaths, args: ServerArgs | None = None) -> None:
        """`args`: the time bounds kept here (default deadlines, /health, the
        watchdog); without them (a test's bare manager) none is kept."""
        self.args = args
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        self.to_scheduler = PushSocket(self.ctx, ipc.scheduler_input)
        self.from_scheduler: AsyncPullSocket[ToTokenizerMsg] = AsyncPullSocket(
            self.actx, ipc.tokenizer_input, ToTokenizerMsg, bind=True)
        self.states: dict[str, ReqState] = {}
        self.queries: dict[str, asyncio.Future[SchedulerReply]] = {}
        # aborts (and stops) the scheduler's queue refused, by rid: retried until
        # sent (or the request finished anyway), so a freed client never leaves its KV held
        self.pending_aborts: dict[str, AbortReq | StopMatchedReq] = {}
        self._retry_task: asyncio.Task[None] | None = None
        self.metrics = ServerMetrics()
        self._loop_task: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()  # the scheduler's last message of any kind
        self.model_silent_s = 0.0  # from its last heartbeat: how long the model has owed a step
        self.watchdog_error: str | None = None  # the scheduler's watchdog stopped the server: why

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def close(self) -> None:
        for task in (self._loop_task, self._retry_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self.to_scheduler.close()
        self.from_scheduler.close()
        self.ctx.term()
        self.actx.term()

    def submit(self, req: TokenizedGenerateReq, arrival: float, event: asyncio.Event | None = None,
               group: str | None = None) -> ReqState:
        """Registers and sends a request; `arrival` is its perf_counter() time;
        `event` (optional) is shared with other requests of the same client."""
        if req.rid in self.states:
            raise DuplicateRidError(f"a request with rid {req.rid!r} is already running")
        state = ReqState(rid=req.rid, prompt_tokens=len(req.input_ids), arrival=arrival,
                         event=event or asyncio.Event(), group=group,
                         arrival_wall=req.arrival_time or time.time())
        self.states[req.rid] = state
        try:
            # never block the event loop: a full queue means the scheduler is stuck or gone
            self.to_scheduler.send(req, block=False)
        except zmq.Again:
            del self.states[req.rid]
            raise ServiceUnavailableError("the scheduler is not taking requests") from None
        except Exception:
            del self.states[req.rid]
            raise
        timeout = req.timeout_s if req.timeout_s is not None else \
            (self.args.request_timeout_s if self.args is not None else None)
        if timeout is not None:
            deadline = state.arrival_wall + timeout
            state.deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline + DEADLINE_GRACE_S - time.time()), self._deadline_passed, state, deadline)
        return state

    def _deadline_passed(self, state: ReqState, deadline: float) -> None:
        """The request is past its deadline and the scheduler has not ended it
        (it may be stopped, or stuck waiting for the model): the client gets
        its abort now, and the scheduler is asked to free the KV. The state
        stays registered until the scheduler's final row, so its rid is not
        reused while the scheduler still holds it."""
        state.deadline_timer = None
        if state.finished or self.states.get(state.rid) is not state:
            return
        if self.engine_answering() and time.time() < deadline + DEADLINE_MAX_GRACE_S:
            state.deadline_timer = asyncio.get_running_loop().call_later(
                DEADLINE_RECHECK_S, self._deadline_passed, state, deadline)
            return
        logger.warning("request %s is past its deadline and the scheduler has not ended it: ending it here",
                       state.rid)
        if not state.abort_sent:
            self._end(state, AbortReq(rid=state.rid))
        state.finish_reason = FinishAbort(AbortKind.DEADLINE, DEADLINE_EXCEEDED)
        state.event.set()

    def abort(self, state: ReqState) -> None:
        """Asks the scheduler to drop the request (its KV is freed at once). The
        state stays registered until the scheduler's final row arrives."""
        if state.finished or state.abort_sent:
            return
        logger.info("abort request %s", state.rid)
        self._end(state, AbortReq(rid=state.rid))

    def stop(self, state: ReqState, matched: str) -> None:
        """Tells the scheduler the request stopped on the stop string `matched`
        (found here, in the text), so it ends it as a stop."""
        if not (state.finished or state.abort_sent):
            self._end(state, StopMatchedReq(rid=state.rid, matched=matched))

    def _end(self, state: ReqState, msg: AbortReq | StopMatchedReq) -> None:
        state.abort_sent = True
        try:
            self.to_scheduler.send(msg, block=False)
        except zmq.Again:
            logger.warning("abort of %s not sent yet: the scheduler's queue is full; retrying", state.rid)
            self.pending_aborts[state.rid] = msg
            if self._retry_task is None or self._retry_task.done():
                self._retry_task = asyncio.get_running_loop().create_task(self._retry_aborts())

    async def _retry_aborts(self) -> None:
        while self.pending_aborts:
            await asyncio.sleep(ABORT_RETRY_S)
            for rid, msg in list(self.pending_aborts.items()):
                if rid not in self.states:  # finished meanwhile: nothing to abort
                    del self.pending_aborts[rid]
                    continue
                try:
                    self.to_scheduler.send(msg, block=False)
                except zmq.Again:
                    break  # still full: the rest wait too, in order
                del self.pending_aborts[rid]

    def abort_rid(self, rid: str) -> list[str]:
        """Aborts the request `rid`, or every request of the group `rid`;
        returns the rids aborted."""
        hits = [s for s in self.states.values() if rid in (s.rid, s.group)]
        for state in hits:
            self.abort(state)
        return [s.rid for s in hits]

    def abort_all(self) -> list[str]:
        states = list(self.states.values())
        for state in states:
            self.abort(state)
        return [s.rid for s in states]

    def forget(self, state: ReqState) -> None:
        """Stops tracking a request the scheduler may never answer (a health
        check that timed out); a late row for it is then dropped."""
        self.states.pop(state.rid, None)
        self._cancel_deadline(state)

    @staticmethod
    def _cancel_deadline(state: ReqState) -> None:
        if state.deadline_timer is not None:
            state.deadline_timer.cancel()
            state.deadline_timer = None

    # ---- is the engine alive? -----------------------------------------------------------

    def scheduler_silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def engine_answering(self) -> bool:
        return self.scheduler_silent_s() < ANSWERING_WITHIN_S and self.model_silent_s < ANSWERING_WITHIN_S

    def unresponsive(self) -> str | None:
        """Why /health should say 503: the scheduler, or the model through it,
        has not answered for --health-check-timeout; None when both answer."""
        if self.args is None:
            return None
        bound = self.args.health_check_timeout
        silent = self.scheduler_silent_s()
        if silent > bound:
            return f"the scheduler has not answered for {silent:.1f} s"
        if self.model_silent_s > bound:
            return f"the model process has not answered a step for {self.model_silent_s:.1f} s"
        return None

    def hung(self) -> str | None:
        """Why the server must stop as on a crash: the scheduler's watchdog
        fired, or the scheduler itself has been silent for --watchdog-timeout
        while requests are in flight (its own watchdog cannot run then)."""
        if self.watchdog_error is not None:
            return self.watchdog_error
        limit = self.args.watchdog_timeout if self.args is not None else 0.0
        silent = self.scheduler_silent_s()
        if limit and self.states and silent > limit:
            return f"watchdog: the scheduler has not answered for {silent:.1f} s (--watchdog-timeout {limit:g})"
        return None

    def finish_all(self, message: str) -> None:
        """Ends every request in flight at once (server shutdown: the scheduler
        is stopping too), so their clients get an answer instead of a hang."""
        for state in list(self.states.values()):
            state.finish_reason = FinishAbort(AbortKind.SHUTDOWN, message)
            state.event.set()
        self.states.clear()

    async def query_scheduler(self, query: type[StateQuery] | type[FlushCacheQuery] | type[TimelineQuery], timeout: float = 5.0,
                              **fields: Any) -> SchedulerReply:
        """Ask the scheduler `query(query_id, **fields)`; raises
        asyncio.TimeoutError if it does not answer."""
        query_id = uuid.uuid4().hex
        future: asyncio.Future[SchedulerReply] = asyncio.get_running_loop().create_future()
        self.queries[query_id] = future
        try:
            try:
                self.to_scheduler.send(query(query_id=query_id, **fields), block=False)
            except zmq.Again:
                raise asyncio.TimeoutError("the scheduler is not taking messages") from None
            return await asyncio.wait_for(future, timeout)
        finally:
            self.queries.pop(query_id, None)

    async def _output_loop(self) -> None:
        while True:
            try:
                out = await self.from_scheduler.recv()
                self.last_heard = time.monotonic()
                if isinstance(out, SchedulerHeartbeat):
                    self.model_silent_s = out.model_silent_s
                    if out.watchdog_error:
                        self.watchdog_error = out.watchdog_error
                    continue
                if isinstance(out, SchedulerReply):
                    future = self.queries.get(out.query_id)
                    if future is not None and not future.done():
                        future.set_result(out)
                    continue
                self._dispatch(out)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad message must not stop every request
                logger.exception("bad message from the scheduler")

    def _dispatch(self, out: BatchTokenOut) -> None:
        for i, rid in enumerate(out.rids):
            state = self.states.get(rid)
            if state is None:
                continue  # not ours any more (should not happen)
            if state.finished:  # ended here (its deadline): its client has its answer
                if out.finished_reasons[i] is not None:
                    self._retire(state, out.completion_tokens[i])
                continue
            state.output_ids.extend(out.new_token_ids[i])
            if i < len(out.output_token_logprobs):
                state.token_logprobs.extend(out.output_token_logprobs[i])
            if i < len(out.output_top_logprobs):
                state.top_logprobs.extend(out.output_top_logprobs[i])
            if i < len(out.input_token_logprobs) and out.input_token_logprobs[i]:
                state.input_token_logprobs = list(out.input_token_logprobs[i])
                state.input_top_logprobs = list(out.input_top_logprobs[i])
                if i < len(out.input_token_ids_logprobs):
                    state.input_token_ids_logprobs = list(out.input_token_ids_logprobs[i])
            if i < len(out.output_token_ids_logprobs):
                state.token_ids_logprobs.extend(out.output_token_ids_logprobs[i])
            state.prompt_tokens = out.prompt_tokens[i]
            state.completion_tokens = out.completion_tokens[i]
            state.cached_tokens = out.cached_tokens[i]
            state.num_retractions = out.num_retractions[i]
            if out.spec_verify_ct:
                state.spec = (out.spec_verify_ct[i], out.spec_accepted_tokens[i])
            if out.queue_times:
                state.queue_time = out.queue_times[i]
            if out.first_token_times and out.first_token_times[i]:
                state.first_token_wall = out.first_token_times[i]
            if out.finished_reasons[i] is not None:
                state.finish_reason = out.finished_reasons[i]
                self._retire(state, state.completion_tokens)
            state.event.set()

    def _retire(self, state: ReqState, completion_tokens: int) -> None:
        """The scheduler's final row for the request: its rid is free again."""
        assert state.finish_reason is not None
        del self.states[state.rid]
        self._cancel_deadline(state)
        self.metrics.observe_finished(
            prompt_tokens=state.prompt_tokens, completion_tokens=completion_tokens,
            cached_tokens=state.cached_tokens, finish_type=state.finish_reason.type, arrival=state.arrival_wall,
            first_token=state.first_token_wall, finished=time.time())
