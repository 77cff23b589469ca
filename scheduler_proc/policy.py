"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from scheduler_proc.req import Req

LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm costs more than it saves: fcfs
# lpm's starvation bound: lpm lets later arrivals with a longer cache hit go
# first, which could pass over a cache miss for as long as hits keep coming
# (users report minute-long TTFT tails for misses under lpm). A request that
# has waited this long goes ahead of lpm's order, in arrival order. It orders
# requests of equal (effective) priority only: it never overrides priorities.
MAX_PASS_OVER_S = 5.0


def effective_priority(req: Req, now: float, aging_s: float | None, low_priority_first: bool) -> int:
    """The request's priority, larger first (with `low_priority_first` a
    smaller value is a higher priority), raised one level for every `aging_s`
    seconds it has waited since it last entered the queue (None: no aging).
    Whole levels, so requests of one priority that waited alike tie, and the
    policy's order decides among them."""
    base = -req.priority if low_priority_first else req.priority
    if aging_s is None:
        return base
    return base + math.floor(max(0.0, now - req.waiting_since) / aging_s)


def order_waiting_queue(queue: deque[Req], policy: str,
                        match_len: Callable[[Req], int] | None,
                        now: float | None = None, by_priority: bool = False,
                        low_priority_first: bool = False,
                        aging_s: float | None = None) -> deque[Req]:
    """fcfs keeps arrival order (retracted requests sit at the front). lpm puts
    the requests with the longest prefix in the cache (`match_len`) first,
    ties in fcfs order, except that requests that have waited longer than
    MAX_PASS_OVER_S go first, in arrival order; without a cache (`match_len`
    None) lpm is fcfs, as in SGLang. `by_priority`
    (--enable-priority-scheduling): by effective priority (`effective_priority`:
    the request's priority, aged by `aging_s`, --priority-aging-s), the
    policy's order among equals. Aging lets a request of lower priority pass a
    higher one only after waiting `aging_s` seconds per level of difference,
    so no request waits forever while higher ones keep arriving, and a high
    priority still goes first over lower ones that have not waited that long."""
    use_lpm = policy == "lpm" and match_len is not None and len(queue) <= LPM_MAX_QUEUE
    if len(queue) < 2 or not (use_lpm or by_priority):
        return queue
    now = time.time() if now is None else now
    order = list(queue)
    if use_lpm:
        overdue = [r for r in order if now - r.waiting_since > MAX_PASS_OVER_S]
        rest = [r for r in order if now - r.waiting_since <= MAX_PASS_OVER_S]
        hits = {id(r): match_len(r) for r in rest}  # type: ignore[misc]
        rest.sort(key=lambda r: -hits[id(r)])  # stable: fcfs among ties
        order = overdue + rest
    if by_priority:
        rank = {id(r): effective_priority(r, now, aging_s, low_priority_first) for r in order}
        order.sort(key=lambda r: -rank[id(r)])  # stable: the policy's order among equals
    return deque(order)
