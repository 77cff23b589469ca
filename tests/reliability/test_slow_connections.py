"""1,500 slowloris connections (a header byte every second, never a whole
request head) opened while six clients stream, on a real server with
--header-timeout-s 2: the streams' delivery delay (the front end's share of
their gaps, measured with tests/reliability/test_stall.py's functions) grows
by at most 100 ms over a quiet run, clients that arrive mid-flood are
served, and every slow connection is closed within the timeout (plus a
margin for a loaded 2-core machine). The flood runs in a process of its own,
so it does not slow the test's own reading of the streams."""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing as mp
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests

from tests.e2e.server_process import ServerProcess
from tests.helpers import make_tiny_llama
from tests.reliability.server_probe import shut_down, wait_idle
from tests.reliability.test_stall import STREAMS, largest_delivery_delay, largest_gap
from tokenizer_proc.connections import raise_open_file_limit

SLOW = 1500
TIMEOUT_S = 2.0
CLOSE_MARGIN_S = 3.0  # the timer fires on a loaded event loop
MAX_GROWTH_S = 0.100  # as test_stall's bound
WINDOW_S = 4.0  # how long the streams are read in a quiet run
HEAD = b"GET /get_model_info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 64


@pytest.fixture(scope="module")
def server(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # a tiny random model with the default tokenizer's vocabulary (the point is the front end),
    # and a long context, so that the streams outlast the flood
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny_vocab")), vocab_size=49152,
                            max_position_embeddings=16384)
    srv = ServerProcess("--model-path", model, "--tokenizer-path", default_model_dir, "--dtype", "float32",
                        "--header-timeout-s", str(TIMEOUT_S), startup_timeout=400)
    yield srv
    shut_down(srv)


async def slow_connection(port: int, opened: list[int], lifetimes: list[float]) -> None:
    """Opens a connection and sends a header byte a second; records how long
    the server kept it open."""
    t0 = time.monotonic()  # before the connect: the server's timer starts at its accept
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened[0] += 1
    sent = 0
    try:
        while sent < len(HEAD):
            writer.write(HEAD[sent:sent + 1])
            sent += 1
            try:
                if await asyncio.wait_for(reader.read(4096), 1.0) == b"":
                    break  # closed by the server
            except asyncio.TimeoutError:
                continue
    except (ConnectionResetError, BrokenPipeError):
        pass
    lifetimes.append(time.monotonic() - t0)
    writer.close()


def flood(port: int, ready: Any, go: Any, all_open: Any, out: Any) -> None:
    """The flood process: sets `ready` (imports done), at `go` opens SLOW
    slow connections, sets `all_open` once they are, and puts their lifetimes
    on `out`. (Started before the streams: its interpreter's start, which
    takes a core for seconds, is not the attack.)"""
    raise_open_file_limit()
    ready.set()
    go.wait()

    async def main() -> None:
        opened, lifetimes = [0], []
        tasks = [asyncio.create_task(slow_connection(port, opened, lifetimes)) for _ in range(SLOW)]
        while opened[0] < SLOW and not all(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        all_open.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.put(lifetimes)
    asyncio.run(main())


async def stream(session: aiohttp.ClientSession, url: str, rid: str, stop: asyncio.Event,
                 events: list[tuple[float, int]]) -> None:
    """(wall time received, output tokens shown) of each event, until `stop`
    (the client then leaves; its request is aborted)."""
    body = {"text": "Once upon a time", "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": 16000, "temperature": 0, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                events.append((time.time(), json.loads(raw[6:])["meta_info"]["completion_tokens"]))
            if stop.is_set():
                break


async def run_streams(url: str, port: int, attack: bool) -> tuple[float, float, list[float], list[int]]:
    """Largest gap, largest delivery delay, the slow connections' lifetimes,
    and the statuses of requests from clients that came mid-flood."""
    since, tag = time.time(), uuid.uuid4().hex[:8]
    rids = [f"slowloris-{tag}-{k}" for k in range(STREAMS)]
    stop = asyncio.Event()
    events: list[list[tuple[float, int]]] = [[] for _ in rids]
    lifetimes: list[float] = []
    newcomers: list[int] = []
    if attack:
        ctx = mp.get_context("spawn")
        ready, go, all_open, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=flood, args=(port, ready, go, all_open, out), daemon=True)
        proc.start()
        assert await asyncio.to_thread(ready.wait, 120), "the flood process did not start"
        await asyncio.sleep(1.0)  # its start took a core: let the machine settle
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(stream(session, url, rid, stop, ev)) for rid, ev in zip(rids, events)]
        while not all(len(ev) >= 2 for ev in events):
            await asyncio.sleep(0.02)
        if attack:
            go.set()
            assert await asyncio.to_thread(all_open.wait, 120), "the flood never got its connections open"
            for _ in range(3):  # new clients, with the flood open
                async with session.post(url + "/generate", json={"text": "Hi", "sampling_params": {
                        "max_new_tokens": 4}}, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    newcomers.append(resp.status)
            await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(WINDOW_S)
        stop.set()
        await asyncio.gather(*tasks)
    if attack:
        lifetimes = await asyncio.to_thread(out.get, True, TIMEOUT_S + CLOSE_MARGIN_S + 60)
        proc.join(timeout=10)
    delays = [largest_delivery_delay(url, rid, ev, since) for rid, ev in zip(rids, events)]
    return max(largest_gap(ev) for ev in events), max(delays), lifetimes, newcomers


def test_slowloris_flood_leaves_streams_and_new_clients_alone(server: ServerProcess) -> None:
    # The streams' delivery times are read in this process: its own full
    # collections (a heap grown by the whole suite: 240 ms seen) would count as
    # the server's delay. Its heap is frozen while it measures, as the server's is.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(run_streams(server.url, server.port, attack=False))  # warm-up
        quiet = [asyncio.run(run_streams(server.url, server.port, attack=False))[:2] for _ in range(2)]
        gap, delay, lifetimes, newcomers = asyncio.run(run_streams(server.url, server.port, attack=True))
    finally:
        gc.unfreeze()
    print(f"\nlargest gap (ms): quiet {[round(q[0] * 1000) for q in quiet]}, flood {gap * 1000:.0f}; "
          f"largest delivery delay (ms): quiet {[round(q[1] * 1000) for q in quiet]}, flood {delay * 1000:.0f}; "
          f"{len(lifetimes)} slow connections closed after {min(lifetimes):.2f}-{max(lifetimes):.2f} s")
    assert newcomers == [200, 200, 200]
    assert len(lifetimes) == SLOW
    assert max(lifetimes) < TIMEOUT_S + CLOSE_MARGIN_S
    assert delay - min(q[1] for q in quiet) <= MAX_GROWTH_S
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    wait_idle(server)
