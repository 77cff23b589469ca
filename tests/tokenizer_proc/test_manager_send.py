"""The tokenizer process never blocks its event loop on a stuck scheduler:
once the queue to it is full, a new request is refused with 503 (and not
tracked), an abort is dropped with a log line, a query times out."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import IpcPaths, SamplingParams, TokenizedGenerateReq
from tokenizer_proc.errors import ServiceUnavailableError
from tokenizer_proc.manager import TokenizerManager


def test_a_scheduler_that_never_reads_gets_503_not_a_hang(tmp_path) -> None:
    async def main() -> None:
        manager = TokenizerManager(IpcPaths.in_dir(str(tmp_path)))  # nobody binds scheduler_input
        try:
            sent = 0
            with pytest.raises(ServiceUnavailableError, match="not taking requests"):
                while sent < 100_000:  # ZMQ queues up to its high-water mark (1000), then refuses
                    manager.submit(TokenizedGenerateReq(rid=f"r{sent}", input_ids=[1, 2],
                                                        sampling_params=SamplingParams()), 0.0)
                    sent += 1
            assert sent >= 1, "refused before anything was queued"
            assert f"r{sent}" not in manager.states and len(manager.states) == sent
            manager.abort(manager.states["r0"])  # must return, not block
            with pytest.raises(asyncio.TimeoutError):
                await manager.query_scheduler("state", timeout=0.2)
        finally:
            await manager.close()

    asyncio.run(asyncio.wait_for(main(), 30))
