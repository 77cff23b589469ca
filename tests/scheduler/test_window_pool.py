"""The sliding layers' window pool (scheduler_proc/window_pool.py) as the
cache manager keeps it: a request holds window pages for its last window of
tokens only, every page goes back, and the prefix cache serves a prefix only
when the window before its end is held."""

from __future__ import annotations

import numpy as np

from common.messages import SamplingParams
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.req import Req
from scheduler_proc.window_pool import usable_prefix

WINDOW, PAGE = 8, 4


def make_req(rid: str, tokens: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=list(tokens), sampling_params=SamplingParams(max_new_tokens=200),
               stop_token_ids=frozenset({2}))


def new_cache(window_slots: int = 64) -> CacheManager:
    return CacheManager(pool_size=512, num_rows=4, context_len=256, use_tree=True, page_size=PAGE,
                        window=(WINDOW, window_slots))


def held_by(cache: CacheManager, req: Req) -> int:
    """Window slots paired with the request's own pages."""
    pool = cache.window_pool
    own = cache.table[req.req_pool_idx, req.cached_prefix_len:req.kv_len].astype(np.int64)
    return int(pool.held(own[::PAGE]).sum()) * PAGE


def decode(cache: CacheManager, req: Req, steps: int) -> None:
    for _ in range(steps):
        assert cache.alloc_decode([req]) is not None
        req.output_ids.append(7)
        assert (error := check_kv_invariant(cache)) is None, error


def test_usable_prefix_ends_where_the_window_before_it_is_held():
    def held(pattern: str) -> np.ndarray:
        return np.array([c == "1" for c in pattern])

    assert usable_prefix(held("1" * 20), WINDOW, PAGE) == 20
    # only keys n - 7 .. n - 1 matter: a missing page before them does not
    assert usable_prefix(held("0000" + "1" * 16), WINDOW, PAGE) == 20
    # a missing page among them: the prefix ends before it, where the window is held again
    assert usable_prefix(held("1" * 12 + "0000" + "1111"), WINDOW, PAGE) == 12
    assert usable_prefix(held("0000" + "1111" + "0000" + "1111"), WINDOW, PAGE) == 0


def test_a_decoding_request_holds_window_pages_for_its_last_window_only():
    cache = new_cache()
    req = make_req("a", list(range(10, 40)))
    cache.admit(req, None)
    assert cache.alloc_extend([req], [30]) is not None
    assert held_by(cache, req) == 32  # a prefill holds all its new tokens until its next step
    decode(cache, req, 100)
    assert req.kv_len == 130
    # the next token (130) sees 123..129: those pages, and one opened ahead at most
    assert held_by(cache, req) <= WINDOW + 2 * PAGE
    assert cache.own_slots(req) == 132  # the full pool holds every token
    cache.release(req, cache=False)
    assert cache.window_pool.available() == cache.window_pool.size
    assert check_kv_invariant(cache) is None


def test_a_cached_prefix_is_served_only_as_far_as_its_window_is_held():
    cache = new_cache()
    first = make_req("a", list(range(10, 50)))
    cache.admit(first, None)
    cache.alloc_extend([first], [40])
    decode(cache, first, 30)  # its own pages before 70 - 7 have no window pages any more
    cache.release(first, cache=True)  # all 70 tokens go into the tree
    assert check_kv_invariant(cache) is None

    # the prompt alone: its last window (33..39) was given back, and so was
    # every page before it: nothing to start from
    again = make_req("b", first.fill_ids[:40] + [3, 4])
    match = cache.match(again)
    assert cache.tree.match_prefix(again.fill_ids[:again.prefix_limit]).length == 40
    assert match.length == 0
    # the whole conversation and a new turn: its last window is held
    turn = make_req("c", first.fill_ids[:70] + [5, 6, 7])
    assert cache.match(turn).length == 70


def test_window_pressure_takes_the_passed_windows_of_a_prefix_only_its_request_locks():
    """A prompt prefilled in chunks goes into the prefix cache chunk by chunk,
    locked by its request: its window pages stay (a request arriving later
    can start from them) until the window pool runs short, then the ones
    behind the request's window go back."""
    cache = new_cache(window_slots=48)
    req = make_req("a", list(range(10, 74)))
    cache.admit(req, None)
    for _ in range(4):  # four 16-token chunks, each cached as sent
        assert cache.alloc_extend([req], [16]) is not None
        cache.cache_unfinished(req, req.kv_len)
        assert (error := check_kv_invariant(cache)) is None, error
    # the fourth chunk (48..63) found the pool short: the pages before the
    # window of its first token (48 - 7 = 41, so pages up to 40) went back
    assert req.cached_prefix_len == 64 and cache.window_pool.available() == 48 - 24
    held = cache.window_pool.held(cache.table[req.req_pool_idx, :64].astype(np.int64))
    assert bool(held[40:].all()) and not bool(held[:40].any())
    cache.release(req, cache=False)
    assert check_kv_invariant(cache) is None
