"""Freed KV pages are handed out again before pages never handed out, and the
prefix cache grows into untouched pool memory only up to its idle bound, so
the pool's resident part follows the load (issue 29 item 8)."""

from __future__ import annotations

import random

import numpy as np

from scheduler_proc.memory import PageAllocator
from tests.scheduler.test_prefix_cache import CacheHarness
from tests.scheduler.test_scheduler import assert_no_leak


def pages_of(alloc: PageAllocator, pages: np.ndarray) -> np.ndarray:
    """Every slot of the given pages, as a request's run of positions."""
    return (alloc.first_slots(pages).reshape(-1, 1) + np.arange(alloc.page_size)).reshape(-1)


def test_alloc_after_free_returns_the_pages_just_freed_most_recent_first():
    alloc = PageAllocator(16 * 100, 16)
    a = alloc.alloc_pages(3)
    b = alloc.alloc_pages(2)
    alloc.alloc_pages(4)
    alloc.free(pages_of(alloc, a))
    alloc.free(pages_of(alloc, b))
    assert alloc.touched_slots() == 9 * 16 and alloc.reusable_pages() == 5
    assert alloc.alloc_pages(2).tolist() == b.tolist()  # freed last, handed out first
    assert alloc.alloc_pages(3).tolist() == a.tolist()
    assert alloc.reusable_pages() == 0 and alloc.touched_slots() == 9 * 16
    fresh = alloc.alloc_pages(1)
    assert int(fresh[0]) not in a.tolist() + b.tolist() and alloc.touched_slots() == 10 * 16


def test_random_alloc_and_free_touch_no_more_pages_than_the_peak_held():
    rng = random.Random(0)
    alloc = PageAllocator(16 * 1000, 16)
    held: list[np.ndarray] = []
    peak = 0
    for _ in range(3000):
        if len(held) >= 12 or (held and rng.random() < 0.5):
            alloc.free(pages_of(alloc, held.pop(rng.randrange(len(held)))))
        else:
            pages = alloc.alloc_pages(rng.randint(1, 4))
            assert pages is not None
            held.append(pages)
        peak = max(peak, sum(p.size for p in held))
    assert alloc.touched_slots() == peak * 16  # never a fresh page while a freed one waits
    assert peak < 100  # and the load stayed small against the pool of 1000 pages


def run_distinct_chats(h: CacheHarness, n: int, concurrency: int, seed: int = 0) -> int:
    """n requests with prompts sharing nothing, at most `concurrency` at once;
    returns the most KV slots that requests held at any step."""
    rng = random.Random(seed)
    prompts = [[rng.randint(10, 999) for _ in range(rng.randint(40, 120))] for _ in range(n)]
    peak = submitted = 0
    while submitted < n or not h.sched.is_idle():
        while submitted < n and len(h.sched.cache.resident) < concurrency \
                and not h.sched.queue.waiting:
            h.submit(f"r{submitted}", prompts[submitted], max_new=rng.randint(5, 40))
            submitted += 1
        h.step()
        cache = h.sched.cache
        peak = max(peak, cache.size - cache.available())
    return peak


def test_a_light_load_touches_pages_for_its_peak_and_the_cache_bound_not_the_pool():
    """200 requests that share nothing, 4 at a time, through a pool of 20,000
    slots: every finished request's tokens go into the prefix cache, which
    without a bound fills the pool (all of it becomes resident); with the
    bound the pages ever handed out stay within the peak held plus the bound."""
    common = dict(max_total_tokens=20_000, max_running=4, context_len=512, page_size=16)
    bounded = CacheHarness(prefix_cache_max_idle_tokens=512, **common)
    peak = run_distinct_chats(bounded, 200, concurrency=4)
    touched = bounded.sched.cache.allocator.touched_slots()
    assert touched <= peak + 512 + 4 * 16, (touched, peak)
    assert touched < 2_000
    assert_no_leak(bounded.sched)

    unbounded = CacheHarness(prefix_cache_max_idle_tokens=-1, **common)
    run_distinct_chats(unbounded, 200, concurrency=4)
    assert unbounded.sched.cache.allocator.touched_slots() > 15_000  # what the bound prevents


def test_the_bound_keeps_the_recently_used_prefix_cached():
    """A chat's prompt stays cached across other requests while the idle
    cache is within the bound: the least recently used goes first."""
    h = CacheHarness(max_total_tokens=20_000, context_len=512, page_size=16,
                     prefix_cache_max_idle_tokens=1024)
    system = list(range(100, 228))  # 128 tokens: 8 pages
    h.submit("first", system + [1], max_new=3)
    h.run_until_idle()
    for i in range(30):
        h.submit(f"other{i}", [500 + i] * 40, max_new=3)
        h.run_until_idle()
        if i % 5 == 4:  # the chat comes back now and then: recently used again
            h.submit(f"again{i}", system + [2], max_new=3)
            h.run_until_idle()
            assert h.field(f"again{i}", "cached_tokens") >= 128
    assert h.sched.cache.allocator.touched_slots() <= 1024 + 8 * 16 + 64
    assert_no_leak(h.sched)
