"""The tokenizer process never blocks its event loop on a stuck scheduler:
once the queue to it is full, a new request is refused with 503 (and not
tracked), an abort is kept and retried until the scheduler takes it, a query
times out."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import IpcPaths, SamplingParams, StateQuery, TokenizedGenerateReq
from tokenizer_proc.errors import ServiceUnavailableError
from tokenizer_proc.manager import TokenizerManager


def test_a_scheduler_that_never_reads_gets_503_not_a_hang(tmp_path) -> None:
    async def main() -> None:
        manager = TokenizerManager(IpcPaths.in_dir(str(tmp_path)))  # nobody binds scheduler_input
        try:
            sent = 0
            with pytest.raises(ServiceUnavailableError, match="not taking requests"):
                while sent < 100_000:  # ZMQ queues up to its high-water mark, then refuses
                    manager.submit(TokenizedGenerateReq(rid=f"r{sent}", input_ids=[1, 2],
                                                        sampling_params=SamplingParams()), 0.0)
                    sent += 1
            assert sent >= 1, "refused before anything was queued"
            assert f"r{sent}" not in manager.states and len(manager.states) == sent
            manager.abort(manager.states["r0"])  # must return, not block
            with pytest.raises(asyncio.TimeoutError):
                await manager.query_scheduler(StateQuery, timeout=0.2)
        finally:
            await manager.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_abort_refused_by_a_full_queue_is_retried_until_the_scheduler_has_it(tmp_path) -> None:
    """The queue to the scheduler is full when the client goes away: the abort
    waits, and is delivered as soon as the scheduler reads again."""
    import zmq

    from common.ipc import PullSocket
    from common.messages import AbortReq, ToSchedulerMsg

    async def main() -> None:
        ipc = IpcPaths.in_dir(str(tmp_path))
        manager = TokenizerManager(ipc)
        ctx = zmq.Context()
        scheduler: PullSocket = PullSocket(ctx, ipc.scheduler_input, ToSchedulerMsg, hwm=1)
        try:
            sent = 0
            with pytest.raises(ServiceUnavailableError):
                while sent < 100_000:  # fill every queue on the way
                    manager.submit(TokenizedGenerateReq(rid=f"r{sent}", input_ids=[1, 2],
                                                        sampling_params=SamplingParams()), 0.0)
                    sent += 1
            manager.abort(manager.states["r0"])
            assert "r0" in manager.pending_aborts  # not sent, not dropped
            got: list = []
            for _ in range(2000):  # the scheduler reads again
                got += scheduler.recv_nowait()
                if any(isinstance(m, AbortReq) for m in got):
                    break
                await asyncio.sleep(0.005)
            assert [m.rid for m in got if isinstance(m, AbortReq)] == ["r0"]
            assert not manager.pending_aborts
        finally:
            scheduler.close()
            ctx.term()
            await manager.close()

    asyncio.run(asyncio.wait_for(main(), 60))
