"""An asyncio client for `/generate` that records exactly what came back, so a
load test can tell completed, refused, lost and duplicated requests apart."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Outcome:
    rid: str
    stream: bool
    status: int | None = None  # HTTP status; None when no response came
    body: dict[str, Any] | None = None  # the JSON answer, or the stream's final event
    finals: int = 0  # events/answers that carried a finish_reason (must be exactly 1)
    events: int = 0  # streamed data events
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None  # transport trouble (dropped connection, timeout)
    elapsed: float = 0.0
    stream_errors: list[Any] = field(default_factory=list)  # error events inside a stream

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return (self.body or {}).get("meta_info", {}).get("finish_reason")


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """No connection limit (0) by default: a load test wants every request on
    the wire at once."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True))


async def generate(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   timeout: float = 120.0) -> Outcome:
    out = Outcome(rid=str(body.get("rid")), stream=bool(body.get("stream")))
    t0 = time.monotonic()
    try:
        async with session.post(url + "/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            out.status = resp.status
            if resp.status != 200 or not out.stream:
                out.body = json.loads(await resp.read())
                if resp.status == 200:
                    out.finals = 1
            else:
                await _read_stream(resp, out)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.elapsed = time.monotonic() - t0
    return out


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        if payload == b"[DONE]":
            out.done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            out.stream_errors.append(event["error"])
            continue
        out.events += 1
        out.body = event
        if event["meta_info"]["finish_reason"] is not None:
            out.finals += 1
