"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from scheduler_proc.req import Req

LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm costs more than it saves: fcfs
# lpm and priorities let later arrivals go first, which can pass over a request
# for as long as such arrivals keep coming (users report minute-long TTFT tails
# for cache misses under lpm). A request that has waited this long in the
# queue goes first, whatever the policy (aging). fcfs never passes one over.
MAX_PASS_OVER_S = 5.0


def order_waiting_queue(queue: deque[Req], policy: str,
                        match_len: Callable[[Req], int] | None,
                        now: float | None = None, by_priority: bool = False,
                        low_priority_first: bool = False) -> deque[Req]:
    """fcfs keeps arrival order (retracted requests sit at the front). lpm puts
    the requests with the longest prefix in the cache (`match_len`) first,
    ties in fcfs order; without a cache (`match_len` None) lpm is fcfs, as in
    SGLang. `by_priority` (--enable-priority-scheduling): higher `priority`
    first (lower with `low_priority_first`), the policy's order among equals.
    Either way, requests that have waited longer than MAX_PASS_OVER_S since
    they (re)entered the queue go first, in arrival order."""
    use_lpm = policy == "lpm" and match_len is not None and len(queue) <= LPM_MAX_QUEUE
    if len(queue) < 2 or not (use_lpm or by_priority):
        return queue
    now = time.time() if now is None else now
    overdue = [r for r in queue if now - r.waiting_since > MAX_PASS_OVER_S]
    rest = [r for r in queue if now - r.waiting_since <= MAX_PASS_OVER_S]
    if use_lpm:
        hits = {id(r): match_len(r) for r in rest}  # type: ignore[misc]
        rest.sort(key=lambda r: -hits[id(r)])  # stable: fcfs among ties
    if by_priority:
        sign = 1 if low_priority_first else -1
        rest.sort(key=lambda r: sign * r.priority)  # stable: the policy's order among equals
    return deque(overdue + rest)
