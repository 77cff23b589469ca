"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder."""

from __future__ import annotations

from collections import deque

from scheduler_proc.req import Req

LPM_MAX_QUEUE = 128  # above this many waiting requests, lpm costs more than it saves: fcfs


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def longest_shared_prefix(reqs: list[Req]) -> list[int]:
    """For each request, the longest prefix its prompt shares with any other's.

    In lexicographic order, a prompt's longest match with any other prompt is
    with one of its two neighbours, so one sort replaces the all-pairs scan."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].origin_input_ids)
    best = [0] * len(reqs)
    for a, b in zip(order, order[1:]):
        n = common_prefix_len(reqs[a].origin_input_ids, reqs[b].origin_input_ids)
        best[a] = max(best[a], n)
        best[b] = max(best[b], n)
    return best


def order_waiting_queue(queue: deque[Req], policy: str) -> deque[Req]:
    """fcfs keeps arrival order (retracted requests sit at the front); lpm puts
    requests that share the longest prefix with others first, ties in fcfs order."""
    if policy == "fcfs" or len(queue) > LPM_MAX_QUEUE or len(queue) < 2:
        return queue
    reqs = list(queue)
    shared = longest_shared_prefix(reqs)
    ranked = sorted(range(len(reqs)), key=lambda i: -shared[i])  # stable: fcfs among ties
    return deque(reqs[i] for i in ranked)
