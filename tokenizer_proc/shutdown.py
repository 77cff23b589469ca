"""How the tokenizer/HTTP process stops, without leaving a client hanging.

Two ways out:

- **drain** (SIGTERM from launch.py): stop accepting (the listening socket
  closes, so new connections are refused; a request on a kept-alive
  connection gets 503), let the requests in flight finish for up to
  `--shutdown-timeout` seconds, then abort the rest with a finish reason that
  says why. The scheduler is still up, so their KV is freed too.
- **fail fast** (SIGUSR1 from launch.py, or the peer watch sees the scheduler,
  the model or launch.py die, or the watchdog sees the engine hung: the
  scheduler's watchdog fired, or the scheduler itself has been silent for
  --watchdog-timeout with requests in flight): nothing in flight will ever
  finish, so every request ends at once with an abort carrying status 503 (a
  non-streaming client gets an HTTP 503, a streaming one a final event), and
  the process exits 1, so launch.py takes the server down. A fail fast may
  cut a drain short.

Either way every handler then gets a moment to write its answer before the
process exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from common.messages import AbortKind, FinishAbort
from common.peer_watch import POLL_S, PeerWatch
from tokenizer_proc.errors import error_response
from tokenizer_proc.manager import TokenizerManager

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"
ANSWER_GRACE_S = 2.0  # how long handlers get to write their final answers
TICK_S = 0.05
LOOP_LAG_S = 1.0  # a watch tick this late means the event loop was held up


def end_all(manager: TokenizerManager, reason: FinishAbort, tell_scheduler: bool) -> int:
    """Finishes every request in flight with `reason` and wakes its handler;
    returns how many. The scheduler's late rows for them are then dropped (the
    manager forgets them). `tell_scheduler`: also send it an abort, so it frees
    their KV; never to a dead scheduler (a send with no reader would queue up
    and, past the high-water mark, block the event loop)."""
    states = list(manager.states.values())
    for state in states:
        if tell_scheduler:
            manager.abort(state)
        state.finish_reason = reason
        state.event.set()
    manager.states.clear()
    return len(states)


class Shutdown:
    def __init__(self, get_manager: Callable[[], TokenizerManager | None], shutdown_timeout: float) -> None:
        self.get_manager = get_manager  # the manager exists only once the app started
        self.shutdown_timeout = shutdown_timeout
        self.in_flight = 0  # HTTP handlers running (a stream counts until its last event)
        self.stopping = False  # refuse new requests
        self.failed: str | None = None  # why we fail fast, once we do
        self.requested = asyncio.Event()
        self.sweep: Callable[[], int] | None = None  # ends what is in flight, once we abort

    # ---- wiring -------------------------------------------------------------------------

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """Outermost middleware: refuses requests once stopping (so a probe's
        /health turns 503 too) and counts the handlers in flight."""

        @web.middleware
        async def shutdown_gate(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.stopping:
                resp = error_response(f"{SHUTTING_DOWN}; not accepting requests", 503,
                                      "ServiceUnavailableError")
                resp.force_close()  # and no more requests on this connection
                return resp
            self.in_flight += 1
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1

        return shutdown_gate

    def drain(self) -> None:
        """SIGTERM: stop gracefully (a second one changes nothing)."""
        if not self.requested.is_set():
            logger.info("SIGTERM: no new requests; %d in flight get up to %g s to finish",
                        self.in_flight, self.shutdown_timeout)
        self.requested.set()

    def fail_fast(self, reason: str) -> None:
        """A peer is gone: end everything in flight now (callable from a signal
        handler or a task; only the first call counts)."""
        if self.failed is not None:
            return
        self.failed = reason
        self.stopping = True
        self.requested.set()
        self.sweep = self._end_all_failed
        n = self.sweep()
        logger.error("%s: ended %d request(s) in flight with an error", reason, n)

    async def watch_peers(self, watch: PeerWatch) -> None:
        """Fails fast when launch.py or a sibling process dies, or the engine hangs."""
        last_tick = time.monotonic()
        while True:
            manager = self.get_manager()
            # the scheduler's watchdog names the cause; its exit follows
            reason = (manager.watchdog_error if manager is not None else None) or watch.lost()
            if reason is not None:
                self.fail_fast(reason)
                watch.remove_socket_dir_if_orphaned()
                return
            now = time.monotonic()
            # after this loop itself was held up, the scheduler's messages may be
            # waiting unread: look again next tick, once they are read
            if now - last_tick < POLL_S + LOOP_LAG_S:
                reason = self._hung()
                if reason is not None:
                    self.fail_fast(reason)
                    return
            last_tick = now
            await asyncio.sleep(POLL_S)

    def _hung(self) -> str | None:
        manager = self.get_manager()
        return manager.hung() if manager is not None else None

    # ---- the way out --------------------------------------------------------------------

    async def run(self, runner: web.AppRunner) -> None:
        """Waits until a stop is requested, then stops accepting, drains (unless
        failing fast) and lets every handler write its answer."""
        await self.requested.wait()
        self.stopping = True
        for site in list(runner.sites):
            await site.stop()  # closes the listening socket only; connections stay
        if self.failed is None:
            await self._drain()
        await self._let_handlers_answer()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.in_flight and self.failed is None and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        if self.failed is None and self.in_flight:
            self.sweep = self._end_all_timed_out
            n = self.sweep()
            logger.info("shutdown timeout (%g s): aborted %d request(s) still running",
                        self.shutdown_timeout, n)

    async def _let_handlers_answer(self) -> None:
        deadline = time.monotonic() + ANSWER_GRACE_S
        while self.in_flight and time.monotonic() < deadline:
            # a handler that was still tokenizing may submit after the first sweep
            if self.sweep is not None:
                self.sweep()
            await asyncio.sleep(TICK_S)

    def _end_all_failed(self) -> int:
        manager = self.get_manager()
        if manager is None:
            return 0
        return end_all(manager, FinishAbort(AbortKind.SERVER_DOWN, f"{SHUTTING_DOWN}: {self.failed}"),
                       tell_scheduler=False)

    def _end_all_timed_out(self) -> int:
        manager = self.get_manager()
        if manager is None:
            return 0
        message = (f"{SHUTTING_DOWN}: still running when --shutdown-timeout "
                   f"({self.shutdown_timeout:g} s) ran out")
        return end_all(manager, FinishAbort(AbortKind.SHUTDOWN, message), tell_scheduler=True)
