"""One client request's scheduler requests, handled together.

A client request may fan out (n samples, a list of prompts). Its requests are
submitted together (all or none), share one wake-up event, finish each on its
own, and are aborted together when the client goes away: the handler calls
`abort()` in a `finally`, which touches only requests still running.

Outputs with stop strings or regexes are detokenized and matched on the
worker pool's threads, not the event loop: what arrived is taken on the loop,
applied on a thread, and the handler waits for it before the next wake-up, so
a stream's events keep their order. (RE2 releases the GIL while it searches.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator

from common.messages import FinishMatchedStr, TokenizedGenerateReq
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.finish_json import refusal_error
from tokenizer_proc.logprobs import check_logprob_volume
from tokenizer_proc.manager import DuplicateRidError, ReqState, TokenizerManager
from tokenizer_proc.request_output import Arrival, RequestOutput
from tokenizer_proc.request_spec import RequestSpec
from tokenizer_proc.tokenizer import Tokenizer


WORKERS = 2
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def worker_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that run one request's CPU work off the event loop: stop
    matching, and building a large answer (made on first use)."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="front-worker")
    return _pool


def _apply_all(taken: list[tuple[RequestOutput, Arrival]]) -> list[bool]:
    return [out.apply(arrival) for out, arrival in taken]


class Generation:
    def __init__(self, manager: TokenizerManager, tokenizer: Tokenizer, specs: list[RequestSpec],
                 stream: bool, arrival: float, max_logprob_entries: int | None = None) -> None:
        self.manager = manager
        self.max_logprob_entries = max_logprob_entries  # None: unchecked (the health check's request)
        self.tokenizer = tokenizer
        self.specs = specs
        self.stream = stream
        self.arrival = arrival  # perf_counter() when the HTTP request came in
        self.event = asyncio.Event()
        self.outputs: list[RequestOutput] = []

    def submit(self) -> None:
        """Sends every request, or none (a taken rid, or logprobs past
        --max-logprob-entries, is a 400)."""
        if self.max_logprob_entries is not None:
            check_logprob_volume(self.specs, self.max_logprob_entries)
        rids = [s.req.rid for s in self.specs]
        taken = next((r for r in rids if r in self.manager.states), None)
        if taken is None and len(set(rids)) < len(rids):
            taken = next(r for r in rids if rids.count(r) > 1)
        if taken is not None:
            raise BadRequestError(f"a request with rid {taken!r} is already running")
        try:
            for spec in self.specs:
                self.outputs.append(RequestOutput(self._submit_one(spec), spec, self.tokenizer))
        except BaseException:
            self.abort()
            raise

    def _submit_one(self, spec: RequestSpec) -> ReqState:
        req = spec.req
        # Rows as they come when stop strings are to be matched here, so a
        # match can end the request early even when the client does not stream.
        req.stream = self.stream or spec.matches_text
        req.arrival_time = time.time()
        try:
            return self.manager.submit(req, self.arrival, event=self.event, group=spec.group)
        except DuplicateRidError as e:
            raise BadRequestError(str(e)) from None

    @property
    def done(self) -> bool:
        return all(o.done for o in self.outputs)

    async def updates(self) -> AsyncIterator[list[int]]:
        """Yields, after each wake-up, the indices of outputs that changed;
        ends when every output is finished."""
        loop = asyncio.get_running_loop()
        while not self.done:
            await self.event.wait()
            self.event.clear()
            changed, off_loop = [], []
            for k, out in enumerate(self.outputs):
                arrival = out.take()
                if arrival is None:
                    continue
                if out.matcher is None:
                    if out.apply(arrival):
                        changed.append(k)
                else:
                    off_loop.append((k, out, arrival))
            if off_loop:
                applied = await loop.run_in_executor(worker_pool(), _apply_all, [(o, a) for _, o, a in off_loop])
                changed = sorted(changed + [k for (k, _, _), c in zip(off_loop, applied) if c])
            for k in changed:
                out = self.outputs[k]
                # finished here: free its KV now; the scheduler records a stop
                # (a stop string or regex) or an abort (stop matching past its budget)
                if out.stopped_here and isinstance(out.finish_reason, FinishMatchedStr):
                    self.manager.stop(out.state, out.finish_reason.text)
                elif out.stopped_here:
                    self.manager.abort(out.state)
            if changed:
                yield changed

    async def admitted(self) -> None:
        """Waits for the scheduler's first answer and raises its refusal if it
        refused a request at admission. A streaming route calls this before it
        sends its headers, so the refusal is an HTTP 503 or 400, not an error
        event after a 200. The wake-up is left set for `updates()`."""
        await self.event.wait()
        self.raise_refusal()

    def raise_refusal(self) -> None:
        """Raises the scheduler's refusal of a request at admission, as its HTTP
        status: 503 (the queue is full) or 400 (it can never run here, e.g. it
        cannot fit the KV pool even alone)."""
        for out in self.outputs:
            error = None if out.state.output_ids else refusal_error(out.state.finish_reason)
            if error is not None:
                raise error

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def abort(self) -> None:
        """Aborts every request the scheduler still runs (client gone, error)."""
        for out in self.outputs:
            self.manager.abort(out.state)

    def forget(self) -> None:
        """Drops the requests from the manager (their scheduler may never answer)."""
        for out in self.outputs:
            self.manager.forget(out.state)
