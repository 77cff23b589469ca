"""The front end never stalls: while 6 clients stream tokens, 10 others post
4 MiB prompts (to /generate, /v1/completions and /v1/chat/completions, all
at once, twice); what the front end adds to the streams' gaps grows by at
most 100 ms over the same streams on a quiet server.

What the front end adds is measured per event: from when the scheduler
produced the oldest token the event newly shows (its /timeline) to the
event's arrival; a stalled event loop delays it by the stall. The streams'
largest raw gap between two events is printed too: on a quiet machine it
moves with the delay, but on a 2-core machine shared with other work it is
dominated by the model's step times, which vary by seconds.

The same measure shows that stop regexes cannot stall the front end: with
eight requests carrying the issue's catastrophic patterns (a backtracking
engine spends seconds a token on them), /health keeps answering within
100 ms and the streams' delivery delay grows by at most 100 ms.

A 4 MiB prompt is longer than any prompt that can fit the context (context
length x the longest token's characters), so it is refused with a 400 before
anything tokenizes it; a prompt that passes that check is tokenized on the
tokenizer pool's threads (tests/tokenizer_proc/test_off_loop.py). What is
left on the event loop per post is reading and decoding the body.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import aiohttp
import pytest
import requests

from tests.e2e.server_process import ServerProcess
from tests.reliability.server_probe import shut_down, wait_idle

STREAMS = 6
POSTERS = 10
BURSTS = 2  # the posters post together this many times during the streams
PROMPT_BYTES = 4 * 2**20
MAX_GROWTH_S = 0.100  # the bound
TOKENS = 64  # per stream: a few seconds on a quiet 2-core CPU
# Quiet and loaded runs, alternated; the smallest largest-gap of each kind is
# compared (best of ROUNDS: a busy machine's scheduling noise, which only
# adds, is filtered out; a stall of the front end would show in every run).
ROUNDS = 3
STREAM_BODY = {"text": "Once upon a time", "stream": True,
               "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-running-requests", "16")
    yield srv
    shut_down(srv)


def huge_bodies() -> list[tuple[str, bytes]]:
    text = ("The quick brown fox jumps over the lazy dog. " * (PROMPT_BYTES // 45 + 1))[:PROMPT_BYTES]
    bodies = [("/generate", {"text": text, "sampling_params": {"max_new_tokens": 4}}),
              ("/v1/completions", {"prompt": text, "max_tokens": 4}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4})]
    return [(path, json.dumps(body).encode()) for path, body in bodies]


async def stream_events(session: aiohttp.ClientSession, url: str, rid: str, started: asyncio.Event,
                        count: list[int]) -> list[tuple[float, int]]:
    """(wall time received, output tokens shown) of each event of one stream."""
    events = []
    async with session.post(url + "/generate", json={**STREAM_BODY, "rid": rid}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                events.append((time.time(), json.loads(raw[6:])["meta_info"]["completion_tokens"]))
                if len(events) == 1:
                    count[0] += 1
                    if count[0] == STREAMS:
                        started.set()
    assert len(events) >= TOKENS // 2, len(events)
    return events


def largest_gap(events: list[tuple[float, int]]) -> float:
    """Between two consecutive events, from the first on (the prefill before
    it is not the front end's)."""
    return max(b[0] - a[0] for a, b in zip(events, events[1:]))


def largest_delivery_delay(url: str, rid: str, events: list[tuple[float, int]], since: float) -> float:
    """The front end's share of the gaps: for each event, from when the
    scheduler produced the oldest token it newly shows (its /timeline: the
    request's first_token, then one decode step each) to the event's arrival.
    A stalled front end delays it; a slow or busy model does not."""
    timeline = requests.get(f"{url}/timeline", params={"since": since}, timeout=30).json()["events"]
    first = next(e["t"] for e in timeline if e.get("rid") == rid and e.get("event") == "first_token")
    produced = [first] + sorted(e["t"] for e in timeline if e["type"] == "step" and e["kind"] == "decode"
                                and e["t"] > first)
    worst, shown = 0.0, 0
    for t, tokens in events:
        if tokens > shown:
            worst = max(worst, t - produced[min(shown, len(produced) - 1)])
            shown = tokens
    return worst


def post_huge(url: str, bodies: list[tuple[str, bytes]], go: threading.Event,
              results: list[tuple[int, str]]) -> None:
    """The posters, on a thread and an event loop of their own, so sending
    40 MiB does not delay the streams' reading in the test itself."""
    async def one(session: aiohttp.ClientSession, path: str, data: bytes) -> None:
        try:
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=60)) as resp:
                results.append((resp.status, (await resp.text())[:300]))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # a stalled server: fail, not hang
            results.append((0, f"{type(e).__name__}: {e}"))

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
            for _ in range(BURSTS):
                await asyncio.to_thread(go.wait)
                go.clear()
                await asyncio.gather(*(one(s, *bodies[k % len(bodies)]) for k in range(POSTERS)))

    asyncio.run(main())


async def run_streams(url: str, loaded: bool) -> tuple[float, float, list[tuple[int, str]]]:
    """Largest gap, largest delivery delay (over the streams), and the posts' answers."""
    results: list[tuple[int, str]] = []
    go = threading.Event()
    poster = None
    if loaded:
        poster = threading.Thread(target=post_huge, args=(url, huge_bodies(), go, results), daemon=True)
        poster.start()
    since, tag = time.time(), uuid.uuid4().hex[:8]
    rids = [f"stall-{tag}-{k}" for k in range(STREAMS)]
    started, count = asyncio.Event(), [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(stream_events(session, url, rid, started, count)) for rid in rids]
        await asyncio.wait_for(started.wait(), 120)
        if loaded:
            for burst in range(BURSTS):
                go.set()  # every poster at once, mid-stream
                while len(results) < POSTERS * (burst + 1):
                    await asyncio.sleep(0.05)
        streams = await asyncio.gather(*tasks)
    if poster is not None:
        poster.join(timeout=60)
    delays = [largest_delivery_delay(url, rid, ev, since) for rid, ev in zip(rids, streams)]
    return max(largest_gap(ev) for ev in streams), max(delays), results


def test_huge_prompts_do_not_delay_other_clients_streams(server: ServerProcess) -> None:
    asyncio.run(run_streams(server.url, loaded=False))  # warm-up
    quiet, loaded, runs = [], [], []
    for _ in range(ROUNDS):
        gap, delay, _ = asyncio.run(run_streams(server.url, loaded=False))
        quiet.append((gap, delay))
        gap, delay, results = asyncio.run(run_streams(server.url, loaded=True))
        loaded.append((gap, delay))
        runs.append(results)

    def ms(pairs: list[tuple[float, float]], k: int) -> str:
        return ", ".join(f"{p[k] * 1000:.0f}" for p in pairs)
    print(f"\nlargest gap between stream events (ms): quiet {ms(quiet, 0)}; with 4 MiB posts {ms(loaded, 0)}"
          f"\nlargest delivery delay (ms): quiet {ms(quiet, 1)}; with 4 MiB posts {ms(loaded, 1)}")
    for results in runs:
        assert len(results) == POSTERS * BURSTS
        for status, text in results:  # refused as too long, before tokenizing
            assert status == 400 and "refused before tokenizing" in text, (status, text)
    # The front end's share of the gaps grows by at most the 100 ms.
    # (The raw largest gap is printed, not asserted: on a 2-core machine that
    # other work shares, the model's own step times vary by seconds.)
    assert min(d for _, d in loaded) - min(d for _, d in quiet) <= MAX_GROWTH_S, (quiet, loaded)
    wait_idle(server)


# Issue 29 item 1: catastrophic backtracking on any text without \x00..\x08
CATASTROPHIC = [rf"(?:[\s\S][\s\S]?)*[\x00\x0{k}]" for k in range(1, 9)]
REGEX_TOKENS = 150
MAX_HEALTH_S = 0.100
REGEX_ROUNDS = 2


class HealthPoller:
    """GET /health every 20 ms on a thread of its own; the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count = url, 0.0, 0
        self.unhealthy: list[str] = []  # answers other than 200 (an assert on this thread would only warn)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with requests.Session() as session:
            while not self.stop.wait(0.02):
                t = time.perf_counter()
                r = session.get(self.url + "/health", timeout=60)
                self.worst = max(self.worst, time.perf_counter() - t)
                self.count += 1
                if r.status_code != 200:
                    self.unhealthy.append(f"{r.status_code} {r.text[:300]}")

    def finish(self) -> float:
        """The slowest answer; fails if /health ever answered other than 200."""
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.unhealthy, f"/health answered {len(self.unhealthy)} times unhealthy: {self.unhealthy[:3]}"
        return self.worst


async def regex_request(session: aiohttp.ClientSession, url: str, pattern: str, started: asyncio.Event,
                        count: list[int], total: int) -> dict:
    """One streamed request with a catastrophic stop regex; its last event."""
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": REGEX_TOKENS, "temperature": 0, "ignore_eos": True,
                                "stop_regex": pattern}}
    last = None
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                if last is None:
                    count[0] += 1
                    if count[0] == total:
                        started.set()
                last = json.loads(raw[6:])
    return last


async def run_beside_regexes(url: str, attack: bool) -> tuple[float, float, float, list[dict]]:
    """Largest gap and delivery delay of six streams, the slowest /health, and
    the regex requests' last events; the streams start once every regex
    request is generating."""
    since, tag = time.time(), uuid.uuid4().hex[:8]
    rids = [f"regex-stall-{tag}-{k}" for k in range(STREAMS)]
    poller = HealthPoller(url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        regex_started, regex_count = asyncio.Event(), [0]
        regexes = [asyncio.create_task(regex_request(session, url, p, regex_started, regex_count, len(CATASTROPHIC)))
                   for p in (CATASTROPHIC if attack else [])]
        if attack:
            await asyncio.wait_for(regex_started.wait(), 120)
        started, count = asyncio.Event(), [0]
        streams = await asyncio.gather(*(stream_events(session, url, rid, started, count) for rid in rids))
        finals = await asyncio.gather(*regexes)
    worst_health = poller.finish()
    delays = [largest_delivery_delay(url, rid, ev, since) for rid, ev in zip(rids, streams)]
    return max(largest_gap(ev) for ev in streams), max(delays), worst_health, finals


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random model with the real tokenizer: the front end's work is the
    real one, the model's steps are short (its text is what the regexes read)."""
    from common.server_args import ServerArgs
    from model_proc.weights import resolve_model_path
    from tests.helpers import make_tiny_llama

    args = ServerArgs()
    tokenizer = resolve_model_path(args.model_path, args.cache_dir)
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny_regex")), vocab_size=49152,
                            max_position_embeddings=2048, eos_token_id=2)
    srv = ServerProcess("--model-path", model, "--tokenizer-path", tokenizer, "--dtype", "float32",
                        "--attention-backend", "torch", "--max-running-requests", "16")
    yield srv
    shut_down(srv)


def test_catastrophic_stop_regexes_do_not_stall_the_front_end(tiny_server: ServerProcess) -> None:
    server = tiny_server
    quiet, loaded = [], []
    for _ in range(REGEX_ROUNDS):
        gap, delay, health, _ = asyncio.run(run_beside_regexes(server.url, attack=False))
        quiet.append((gap, delay, health))
        gap, delay, health, finals = asyncio.run(run_beside_regexes(server.url, attack=True))
        loaded.append((gap, delay, health))
        for last in finals:  # each runs to its length, or stops on its pattern: never an abort
            reason = last["meta_info"]["finish_reason"]
            assert reason["type"] == "length" or reason.get("matched") in CATASTROPHIC, last

    def ms(rows: list[tuple[float, float, float]], k: int) -> str:
        return ", ".join(f"{r[k] * 1000:.0f}" for r in rows)
    print(f"\nlargest gap between stream events (ms): quiet {ms(quiet, 0)}; beside 8 catastrophic regexes "
          f"{ms(loaded, 0)}\nlargest delivery delay (ms): quiet {ms(quiet, 1)}; beside the regexes {ms(loaded, 1)}"
          f"\nslowest /health (ms): quiet {ms(quiet, 2)}; beside the regexes {ms(loaded, 2)}")
    # Best of the rounds (as above: a busy machine's noise only adds; a stall
    # of the front end would show in every round).
    assert min(h for _, _, h in loaded) < MAX_HEALTH_S, loaded
    assert min(d for _, d, _ in loaded) - min(d for _, d, _ in quiet) <= MAX_GROWTH_S, (quiet, loaded)
    wait_idle(server)
