"""A bounded record of what the scheduler did: per-request events and per-step stats.

Served at GET /timeline?since=<t>&after_seq=<n> and drawn by /dashboard and
bench/plots/timeline_plot.py.
The ring buffer drops the oldest events beyond its bound, so memory stays flat
under any load; recording is one small dict per event.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

DEFAULT_CAPACITY = 50_000  # events kept (~100 bytes each in msgpack)
MAX_EVENTS_PER_CALL = 5_000  # one answer stays small; a reader continues from next_seq

# Request events, in the order a request can go through them.
REQ_EVENTS = ("arrived", "admitted", "chunk", "first_token", "retracted", "readmitted", "finished")


class Timeline:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.seq = 0  # events ever recorded; a client can tell it missed some

    def _add(self, event: dict[str, Any]) -> None:
        self.seq += 1
        event["seq"] = self.seq
        self.events.append(event)

    def request(self, rid: str, event: str, t: float | None = None, **fields: Any) -> None:
        self._add({"t": time.time() if t is None else t, "type": "req", "rid": rid,
                   "event": event, **fields})

    def step(self, *, kind: str, batch_size: int, tokens: int, kv_usage: float, step_time: float,
             t: float | None = None, accepted: int = 0) -> None:
        """accepted: a verify step's draft tokens kept (speculative decoding)."""
        event = {"t": time.time() if t is None else t, "type": "step", "kind": kind,
                 "batch_size": batch_size, "tokens": tokens, "kv_usage": kv_usage, "step_time": step_time}
        if kind == "verify":
            event["accepted"] = accepted
        self._add(event)

    def since(self, t: float = 0.0, after_seq: int = 0,
              limit: int = MAX_EVENTS_PER_CALL) -> tuple[list[dict[str, Any]], bool]:
        """The oldest `limit` events newer than time `t` and after sequence number
        `after_seq`, and whether more follow them (ask again after the last
        one's `seq`)."""
        newer: list[dict[str, Any]] = []
        for event in reversed(self.events):
            if event["t"] <= t or event["seq"] <= after_seq:
                break
            newer.append(event)
        newer.reverse()
        return newer[:limit], len(newer) > limit
