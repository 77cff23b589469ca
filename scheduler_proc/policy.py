"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from scheduler_proc.req import Req

LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm costs more than it saves: fcfs
# lpm lets requests with long cache hits go first, which can pass over a request
# with no hit for as long as hits keep coming (users report minute-long TTFT
# tails for cache misses). A request that has waited this long goes first.
LPM_MAX_WAIT_S = 5.0


def order_waiting_queue(queue: deque[Req], policy: str,
                        cached_len: Callable[[Req], int] | None,
                        now: float | None = None) -> deque[Req]:
    """fcfs keeps arrival order (retracted requests sit at the front). lpm puts
    the requests with the longest prefix in the cache (`cached_len`) first,
    ties in fcfs order, after any request waiting longer than LPM_MAX_WAIT_S.
    Without a cache (`cached_len` None) lpm is fcfs, as in SGLang."""
    if policy == "fcfs" or cached_len is None or len(queue) > LPM_MAX_QUEUE or len(queue) < 2:
        return queue
    now = time.time() if now is None else now
    overdue = [r for r in queue if now - r.arrival_time > LPM_MAX_WAIT_S]
    rest = [r for r in queue if now - r.arrival_time <= LPM_MAX_WAIT_S]
    hits = {id(r): cached_len(r) for r in rest}
    rest.sort(key=lambda r: -hits[id(r)])  # stable: fcfs among ties
    return deque(overdue + rest)
