"""A disconnect storm: many clients hang up at random points (before the
first token, mid-stream, while waiting for a non-streaming answer, halfway
through sending the body) on a server whose small KV pool keeps retracting;
then long streams that hang up as soon as they see their request was
retracted. Afterwards no request runs or waits, no KV slot is held, the
tokenizer process tracks nothing, and the server still answers correctly."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import pytest

from tests.e2e.server_process import ServerProcess
from tests.reliability.async_client import generate, new_session
from tests.reliability.greedy_check import check_against_reference
from tests.reliability.server_probe import scheduler_state, shut_down, wait_idle

SEED = 7
NUM_CLIENTS = 120
SPREAD_S = 4.0  # clients start over this long
# Then, on an idle server (optimistic admission again), long streams that all
# start at once and overfill the pool; each hangs up once it sees it was
# retracted (victims: fewest tokens first, so it has to be one of them).
HOGS = 6
HOG_TOKENS = 32
STORM_DEADLINE_S = 120.0
FLAGS = ("--max-running-requests", "8", "--max-total-tokens", "128",
         "--schedule-conservativeness", "0.1")
PROMPTS = ["Once upon a time", "The quick brown fox", "In the year 2050, cities will",
           "Here is a recipe for pancakes: first,", "1, 2, 3, 4, 5,"]
CHECK = {"text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 5,
         "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*FLAGS)
    yield srv
    shut_down(srv)


def gen_body(rng: random.Random, stream: bool, max_new: int) -> dict[str, Any]:
    return {"text": rng.choice(PROMPTS), "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}


async def raw_post(port: int, body: bytes, send: int, linger: float) -> None:
    """Sends headers and the first `send` bytes of `body`, waits, hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + body[:send])
    await writer.drain()
    await asyncio.sleep(linger)
    writer.transport.abort()  # an RST, like a killed client


async def stream_then_hang_up(session: Any, url: str, body: dict[str, Any],
                              stop: Any) -> str:
    """Reads events until `stop(event, count)` is true, then closes the
    connection; returns how it ended."""
    async with session.post(url + "/generate", json=body) as resp:
        count = 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            count += 1
            event = json.loads(line[len(b"data: "):])
            if event["meta_info"]["finish_reason"] is not None:
                return "finished first"
            if stop(event, count):
                resp.close()
                return "hung up" if event["meta_info"]["num_retractions"] == 0 else "hung up, retracted"
    return "ended"


async def one_client(k: int, rng: random.Random, srv: ServerProcess, session: Any) -> str:
    await asyncio.sleep(rng.uniform(0, SPREAD_S))
    kind = rng.choice(["before first token", "mid-stream", "plain, gives up", "half a body",
                       "completes"])
    if kind == "before first token":
        body = json.dumps(gen_body(rng, rng.random() < 0.5, 32)).encode()
        await raw_post(srv.port, body, len(body), rng.uniform(0, 0.1))
    elif kind == "half a body":
        body = json.dumps(gen_body(rng, False, 32)).encode()
        await raw_post(srv.port, body, rng.randrange(len(body)), rng.uniform(0, 0.2))
    elif kind == "mid-stream":
        n = rng.randint(1, 8)
        kind += ": " + await stream_then_hang_up(session, srv.url, gen_body(rng, True, 32),
                                                 lambda e, c: c >= n)
    elif kind == "plain, gives up":
        try:
            await asyncio.wait_for(generate(session, srv.url, gen_body(rng, False, 32)),
                                   rng.uniform(0.05, 3.0))
            kind += ": finished first"
        except asyncio.TimeoutError:
            pass
    else:
        out = await generate(session, srv.url, {**gen_body(rng, rng.random() < 0.5, 8), "rid": f"ok-{k}"})
        assert out.status == 200 and out.error is None and out.finals == 1, out
        assert out.body["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out.body
    return kind


async def storm(srv: ServerProcess) -> Counter[str]:
    rng = random.Random(SEED)
    async with new_session() as session:
        clients = [one_client(k, random.Random(rng.random()), srv, session) for k in range(NUM_CLIENTS)]
        kinds = await asyncio.wait_for(asyncio.gather(*clients), STORM_DEADLINE_S)
    return Counter(kinds)


async def hogs(srv: ServerProcess) -> Counter[str]:
    body = {"text": "1, 2, 3, 4, 5,", "stream": True,  # counts on: no early EOS
            "sampling_params": {"max_new_tokens": HOG_TOKENS, "temperature": 0}}
    async with new_session() as session:
        ends = await asyncio.wait_for(asyncio.gather(*(
            stream_then_hang_up(session, srv.url, body,
                                lambda e, c: e["meta_info"]["num_retractions"] > 0)
            for _ in range(HOGS))), STORM_DEADLINE_S)
    return Counter(f"retraction-watcher: {e}" for e in ends)


async def check_answer(url: str) -> dict[str, Any]:
    async with new_session() as session:
        out = await generate(session, url, CHECK)
    assert out.status == 200 and out.error is None, out
    return out.body


def test_disconnect_storm_leaves_nothing_behind(server: ServerProcess) -> None:
    before = asyncio.run(check_answer(server.url))
    retractions_before = scheduler_state(server)["total_retractions"]
    t0 = time.monotonic()
    kinds = asyncio.run(storm(server))
    t1 = time.monotonic()
    wait_idle(server)  # no request running or waiting, no slot held, nothing tracked
    t2 = time.monotonic()
    kinds += asyncio.run(hogs(server))
    t3 = time.monotonic()
    wait_idle(server)
    print(f"disconnect storm: {dict(kinds)}; storm {t1 - t0:.0f} s, idle after "
          f"{t2 - t1:.1f} s, retraction watchers {t3 - t2:.0f} s")
    assert scheduler_state(server)["total_retractions"] > retractions_before, "no retraction"
    assert kinds["retraction-watcher: hung up, retracted"] > 0, \
        "no client hung up after its request was retracted"
    assert sum(v for k, v in kinds.items() if k.startswith("mid-stream: hung up")) > 0
    after = asyncio.run(check_answer(server.url))
    check_against_reference(after, CHECK["sampling_params"]["max_new_tokens"], before)
