import pytest
import numpy as np

from common.messages import AbortKind, SamplingParams
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.memory import PageAllocator
from scheduler_proc.req import Req
from scheduler_proc.schedule_batch import ROW_FIELDS, ScheduleBatch


def make_req(rid: str, n_prompt: int, temperature: float = 0.0, seed: int | None = None) -> Req:
    sp = SamplingParams(max_new_tokens=8, temperature=temperature, seed=seed)
    return Req(rid=rid, origin_input_ids=list(range(10, 10 + n_prompt)), sampling_params=sp,
               stop_token_ids=frozenset({2}))


def new_cache() -> CacheManager:
    return CacheManager(pool_size=100, num_rows=4, context_len=64, use_tree=False)


def prefilled_batch(reqs, cache: CacheManager) -> ScheduleBatch:
    for r in reqs:
        cache.admit(r, None)
    batch = ScheduleBatch.init_new(reqs)
    batch.prepare_for_extend(cache)
    for r in reqs:
        r.output_ids.append(7)
    return batch


def test_prepare_for_extend_writes_table_and_allocates_each_new_token_once():
    cache = new_cache()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = prefilled_batch(reqs, cache)
    assert batch.input_ids == list(range(10, 13)) + list(range(10, 15))
    assert batch.seq_lens == [3, 5] and [r.kv_len for r in reqs] == [3, 5]
    locs = batch.out_cache_loc
    assert len(set(locs.tolist())) == 8 and 0 not in locs.tolist()
    assert cache.allocator.available() == 92
    table = cache.table
    assert table[reqs[0].req_pool_idx, :3].tolist() == locs[:3].tolist()
    assert table[reqs[1].req_pool_idx, :5].tolist() == locs[3:].tolist()


def test_filter_batch_gathers_the_live_rows_of_every_row_field():
    cache = new_cache()
    reqs = [make_req("a", 3, 0.5, 11), make_req("b", 5, 0.7, None), make_req("c", 2, 0.9, 13)]
    batch = prefilled_batch(reqs, cache)
    before = {name: list(getattr(batch, name)) for name in ROW_FIELDS}
    reqs[1].abort(AbortKind.CLIENT_GONE, "gone")
    batch.filter_batch()
    assert [r.rid for r in batch.reqs] == ["a", "c"]
    for name in ROW_FIELDS:
        assert getattr(batch, name) == [before[name][0], before[name][2]], name
    assert batch.temperatures == [0.5, 0.9]
    assert batch.seeds == [11, 13]


def test_filter_batch_with_explicit_indices_reorders():
    cache = new_cache()
    batch = prefilled_batch([make_req("a", 3), make_req("b", 5), make_req("c", 2)], cache)
    batch.filter_batch([2, 0])
    assert [r.rid for r in batch.reqs] == ["c", "a"]
    assert [r.kv_len for r in batch.reqs] == [2, 3]


def test_merge_batch_concatenates_rows_in_order():
    cache = new_cache()
    running = prefilled_batch([make_req("a", 3, seed=1)], cache)
    new = prefilled_batch([make_req("b", 5, seed=2), make_req("c", 2, seed=3)], cache)
    running.merge_batch(new)
    assert [r.rid for r in running.reqs] == ["a", "b", "c"]
    assert [r.kv_len for r in running.reqs] == [3, 5, 2]
    assert running.seeds == [1, 2, 3]
    assert running.req_pool_indices == [r.req_pool_idx for r in running.reqs]
    for name in ROW_FIELDS:
        assert len(getattr(running, name)) == 3


def test_prepare_for_decode_gives_each_row_one_slot_at_its_next_position():
    cache = new_cache()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = prefilled_batch(reqs, cache)
    batch.prepare_for_decode(cache)
    assert batch.forward_mode == "decode"
    assert batch.input_ids == [7, 7]
    assert batch.seq_lens == [4, 6] and [r.kv_len for r in reqs] == [4, 6]
    table = cache.table
    assert table[reqs[0].req_pool_idx, 3].item() == batch.out_cache_loc[0].item()
    assert table[reqs[1].req_pool_idx, 5].item() == batch.out_cache_loc[1].item()


def test_allocator_alloc_and_free_are_exact():
    alloc = PageAllocator(10, page_size=1)
    a = alloc.alloc_pages(4)
    b = alloc.alloc_pages(6)
    assert alloc.alloc_pages(1) is None
    assert sorted(a.tolist() + b.tolist()) == list(range(10))
    alloc.free(alloc.first_slots(a))
    assert alloc.available() == 4
    assert sorted(alloc.alloc_pages(4).tolist()) == sorted(a.tolist())


def test_a_pool_of_pages_leaves_its_partial_last_page_unused():
    alloc = PageAllocator(10, page_size=4)
    assert alloc.size == 8 and alloc.available() == 8
    pages = alloc.alloc_pages(2)
    assert sorted(alloc.first_slots(pages).tolist()) == [1, 5] and alloc.alloc_pages(1) is None


def test_freeing_a_run_that_does_not_start_a_page_is_refused():
    alloc = PageAllocator(16, page_size=4)
    first = int(alloc.first_slots(alloc.alloc_pages(1))[0])
    with pytest.raises(AssertionError, match="do not start pages"):
        alloc.free(np.arange(first + 1, first + 4))


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_moves_only_the_pages_it_hands_out_or_takes_back(page_size: int):
    """Alloc and free copy the pages moved into one preallocated stack: the
    stack is never reallocated or concatenated (a free costs the pages freed,
    not the pool), and under random use the free set is always exact. Runs
    are freed as a request frees its own part: from a page's first slot, the
    last page possibly partly used."""
    import random

    rng = random.Random(0)
    alloc = PageAllocator(1000, page_size)
    storage = alloc.stack.ctypes.data
    held: list[np.ndarray] = []  # slots of whole pages, in page order
    for _ in range(2000):
        if held and (rng.random() < 0.5 or alloc.available() == 0):
            run = held.pop(rng.randrange(len(held)))
            alloc.free(run[:max(1, run.size - rng.randrange(page_size))])  # a partly used last page
        else:
            got = alloc.alloc_pages(rng.randint(1, min(50 // page_size, alloc.available() // page_size)))
            assert got is not None
            held.append((alloc.first_slots(got).reshape(-1, 1) + np.arange(page_size)).reshape(-1))
        out = sorted(t for h in held for t in h.tolist())
        assert len(out) + alloc.available() == 1000 and len(set(out)) == len(out)
    assert alloc.stack.ctypes.data == storage
    for h in held:
        alloc.free(h)
    assert sorted(alloc.stack.tolist()) == list(range(1000 // page_size))


def test_with_pages_each_request_fills_its_own_pages_in_order():
    """A prefill takes whole pages per request, decode continues in the
    request's last page and opens a new one only when it is full, and a
    chunked request's next chunk fills the rest of its page first."""
    cache = CacheManager(pool_size=64, num_rows=4, context_len=64, use_tree=False, page_size=4)
    reqs = [make_req("a", 3), make_req("b", 4)]
    batch = prefilled_batch(reqs, cache)
    assert cache.allocator.available() == 64 - 8  # a page each
    a, b = (cache.table[r.req_pool_idx] for r in reqs)
    assert (a[:3] - a[0]).tolist() == [0, 1, 2] and (a[0] - 1) % 4 == 0
    assert (b[:4] - b[0]).tolist() == [0, 1, 2, 3] and (b[0] - 1) % 4 == 0
    batch.prepare_for_decode(cache)  # a: position 3 in its page; b: a new page
    assert a[3] == a[2] + 1 and (b[4] - 1) % 4 == 0 and cache.allocator.available() == 64 - 12
    assert cache.decode_slots(reqs) == 4  # a's page is full now, b has room
    # a chunk after a partial page: the page's rest, then a new one
    c = make_req("c", 10)
    cache.admit(c, None)
    chunk = ScheduleBatch.init_new([c])
    chunk.prepare_for_extend(cache, [2])
    rest = ScheduleBatch.init_new([c])
    rest.prepare_for_extend(cache, [8])
    row = cache.table[c.req_pool_idx, :10]
    assert (row[:4] - row[0]).tolist() == [0, 1, 2, 3] and (row[4:8] - row[4]).tolist() == [0, 1, 2, 3]
    assert row[9] == row[8] + 1 and cache.allocator.available() == 64 - 12 - 12
    assert check_kv_invariant(cache) is None
    cache.release(c, cache=False)
    assert cache.allocator.available() == 64 - 12


def test_with_pages_a_running_request_caches_whole_pages_and_a_finished_one_its_partial_page_too():
    cache = CacheManager(pool_size=64, num_rows=4, context_len=64, use_tree=True, page_size=4)
    r = make_req("a", 10)
    prefilled_batch([r], cache)
    cache.cache_unfinished(r, 10)  # its last page is still its own to write
    assert r.cached_prefix_len == 8 and cache.tree.evictable_size == 0 and cache.tree.protected_size == 8
    cache.release(r, cache=True)  # all 10 tokens stay: the partial page as a leaf holding the page
    assert cache.tree.evictable_size == 12 and cache.allocator.available() == 64 - 12
    again = make_req("b", 10)
    match = cache.match(again)  # all but the last token: 8 shared, 1 row to copy
    assert match.length == 9 and match.slots.size == 8 and match.copy_slots.size == 1
    assert check_kv_invariant(cache) is None


def test_the_cache_manager_advances_lengths_and_a_refused_allocation_changes_nothing():
    """kv_len has one writer: alloc_extend and alloc_decode advance it over the
    slots they hand out; when the pool cannot hold a step, neither the pool nor
    any length moves."""
    cache = CacheManager(pool_size=8, num_rows=4, context_len=64, use_tree=False, page_size=4)
    a, b = make_req("a", 3), make_req("b", 5)
    for r in (a, b):
        cache.admit(r, None)
    assert cache.alloc_extend([a], [2]) is not None and a.kv_len == 2
    assert cache.alloc_extend([a, b], [1, 5]) is None  # b needs two pages, one is free
    assert (a.kv_len, b.kv_len, cache.allocator.available()) == (2, 0, 4)
    assert cache.alloc_extend([a, b], [1, 4]) is not None and (a.kv_len, b.kv_len) == (3, 4)
    assert cache.alloc_decode([a]) is not None and a.kv_len == 4  # the rest of its page
    assert cache.alloc_decode([a, b]) is None  # both pages full, none free
    assert (a.kv_len, b.kv_len) == (4, 4) and check_kv_invariant(cache) is None
    cache.release(a, cache=False)
    assert a.kv_len == 0 and cache.allocator.available() == 4


def test_the_prefill_adder_returns_what_it_admits_and_changes_no_request():
    from scheduler_proc.prefill_adder import Admitted, PrefillAdder
    adder = PrefillAdder.for_step(max_running=4, running=[], free_slots=100, max_prefill_tokens=100,
                                  chunked_prefill_size=6, new_token_ratio=0.5)
    a, b = make_req("a", 4), make_req("b", 5)
    assert adder.fit(b, prefix_len=1) == (4, 4 + 4) and adder.can_run == []  # a question only
    assert adder.try_add(a) and adder.try_add(b, prefix_len=1)
    assert adder.can_run == [Admitted(a, 4), Admitted(b, 2)] and adder.new_chunked_req is b
    assert (a.kv_len, b.kv_len) == (0, 0)
