"""Requests kept in flight on a server while a test breaks or stops it, each
recording how and when it ended (threads with `requests`, so that what a
plain blocking client sees is what is checked)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

CLIENT_TIMEOUT_S = 90.0  # a hung request fails the test rather than the suite
# A request that outlives any test on any machine: no CPU or GPU generates this
# many tokens of the default model within CLIENT_TIMEOUT_S (a test must not rely
# on a fixed token count outlasting a fixed timeout: a fast machine finishes it).
# It fits SmolLM2's 8192-token context; a server running R of them needs
# --max-total-tokens of at least R * (UNBOUNDED_TOKENS + prompt).
UNBOUNDED_TOKENS = 8000
UNBOUNDED_POOL = "16384"  # --max-total-tokens for two such rows


@dataclass
class Ended:
    name: str
    stream: bool
    status: int | None = None
    final: dict[str, Any] | None = None  # the JSON answer or the last stream event
    error_events: list[Any] = field(default_factory=list)
    done: bool = False  # stream closed with [DONE]
    transport_error: str | None = None
    ended_at: float = 0.0  # time.monotonic()

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return (self.final or {}).get("meta_info", {}).get("finish_reason")

    def is_error_answer(self) -> bool:
        """A clean answer that says the request failed: an HTTP error with the
        error body, or a stream that closed properly after an abort/error."""
        if self.transport_error is not None:
            return False
        if not self.stream or self.status != 200:
            return self.status is not None and self.status >= 500 and "error" in (self.final or {})
        aborted = (self.finish_reason or {}).get("type") == "abort"
        return self.done and (aborted or bool(self.error_events))


class InFlight:
    """Starts requests in background threads; `started` is set once the first
    streaming request has produced a token (so it is running, not queued)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        self.futures: list[concurrent.futures.Future[Ended]] = []
        self.started = threading.Event()

    def add(self, name: str, body: dict[str, Any]) -> None:
        self.futures.append(self.pool.submit(self._run, name, body))

    def _run(self, name: str, body: dict[str, Any]) -> Ended:
        end = Ended(name=name, stream=bool(body.get("stream")))
        try:
            with requests.post(self.url + "/generate", json=body, stream=end.stream,
                               timeout=CLIENT_TIMEOUT_S) as r:
                end.status = r.status_code
                if end.stream and r.status_code == 200:
                    self._read_events(r, end)
                else:
                    end.final = r.json()
        except (requests.RequestException, ValueError) as e:
            end.transport_error = f"{type(e).__name__}: {e}"
        end.ended_at = time.monotonic()
        return end

    def _read_events(self, r: requests.Response, end: Ended) -> None:
        for line in r.iter_lines():
            if not line:
                continue
            payload = line.removeprefix(b"data: ")
            if payload == b"[DONE]":
                end.done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                end.error_events.append(event["error"])
                continue
            end.final = event
            self.started.set()

    def results(self, timeout: float = CLIENT_TIMEOUT_S + 10) -> list[Ended]:
        out = [f.result(timeout=timeout) for f in self.futures]
        self.pool.shutdown()
        return out


def long_body(prompt: str, max_new_tokens: int, stream: bool) -> dict[str, Any]:
    return {"text": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}


def health_code(url: str) -> int | None:
    """GET /health's status, or None when nothing answers."""
    try:
        return requests.get(url + "/health", timeout=2).status_code
    except requests.RequestException:
        return None
