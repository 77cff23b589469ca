import torch

from common.messages import SamplingParams
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.memory import TokenSlotAllocator
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
    for r, s in zip(reqs, batch.seq_lens.tolist()):
        r.kv_len = s
        r.output_ids.append(7)
    return batch


def test_prepare_for_extend_writes_table_and_allocates_each_new_token_once():
    cache = new_cache()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = prefilled_batch(reqs, cache)
    assert batch.input_ids.tolist() == list(range(10, 13)) + list(range(10, 15))
    assert batch.seq_lens.tolist() == [3, 5]
    locs = batch.out_cache_loc
    assert len(set(locs.tolist())) == 8 and 0 not in locs.tolist()
    assert cache.allocator.available() == 92
    table = cache.table
    assert table[reqs[0].req_pool_idx, :3].tolist() == locs[:3].tolist()
    assert table[reqs[1].req_pool_idx, :5].tolist() == locs[3:].tolist()


def test_filter_batch_gathers_the_live_rows_of_every_tensor():
    cache = new_cache()
    reqs = [make_req("a", 3, 0.5, 11), make_req("b", 5, 0.7, None), make_req("c", 2, 0.9, 13)]
    batch = prefilled_batch(reqs, cache)
    before = {name: getattr(batch, name).clone() for name in ROW_FIELDS}
    reqs[1].abort("gone")
    batch.filter_batch()
    assert [r.rid for r in batch.reqs] == ["a", "c"]
    for name in ROW_FIELDS:
        assert torch.equal(getattr(batch, name), before[name][[0, 2]]), name
    assert batch.temperatures.tolist() == [0.5, 0.8999999761581421]
    assert batch.seeds.tolist() == [11, 13]


def test_filter_batch_with_explicit_indices_reorders():
    cache = new_cache()
    batch = prefilled_batch([make_req("a", 3), make_req("b", 5), make_req("c", 2)], cache)
    batch.filter_batch([2, 0])
    assert [r.rid for r in batch.reqs] == ["c", "a"]
    assert batch.seq_lens.tolist() == [2, 3]


def test_merge_batch_concatenates_rows_in_order():
    cache = new_cache()
    running = prefilled_batch([make_req("a", 3, seed=1)], cache)
    new = prefilled_batch([make_req("b", 5, seed=2), make_req("c", 2, seed=3)], cache)
    running.merge_batch(new)
    assert [r.rid for r in running.reqs] == ["a", "b", "c"]
    assert running.seq_lens.tolist() == [3, 5, 2]
    assert running.seeds.tolist() == [1, 2, 3]
    assert running.req_pool_indices.tolist() == [r.req_pool_idx for r in running.reqs]
    for name in ROW_FIELDS:
        assert getattr(running, name).shape[0] == 3


def test_prepare_for_decode_gives_each_row_one_slot_at_its_next_position():
    cache = new_cache()
    reqs = [make_req("a", 3), make_req("b", 5)]
    batch = prefilled_batch(reqs, cache)
    batch.prepare_for_decode(cache)
    assert batch.forward_mode == "decode"
    assert batch.input_ids.tolist() == [7, 7]
    assert batch.seq_lens.tolist() == [4, 6]
    table = cache.table
    assert table[reqs[0].req_pool_idx, 3].item() == batch.out_cache_loc[0].item()
    assert table[reqs[1].req_pool_idx, 5].item() == batch.out_cache_loc[1].item()


def test_allocator_alloc_and_free_are_exact():
    alloc = TokenSlotAllocator(10)
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert alloc.alloc(1) is None
    assert sorted(a.tolist() + b.tolist()) == list(range(1, 11))
    alloc.free(a)
    assert alloc.available() == 4
    assert sorted(alloc.alloc(4).tolist()) == sorted(a.tolist())


def test_allocator_moves_only_the_slots_it_hands_out_or_takes_back():
    """Alloc and free copy the slots moved into one preallocated stack: the
    stack is never reallocated or concatenated (a free costs the slots freed,
    not the pool), and under random use the free set is always exact."""
    import random

    rng = random.Random(0)
    alloc = TokenSlotAllocator(1000)
    storage = alloc.stack.data_ptr()
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or alloc.available() == 0):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            got = alloc.alloc(rng.randint(1, min(50, alloc.available())))
            assert got is not None
            held.append(got)
        out = sorted(t for h in held for t in h.tolist())
        assert len(out) + alloc.available() == 1000 and len(set(out)) == len(out)
    assert alloc.stack.data_ptr() == storage
    for h in held:
        alloc.free(h)
    assert sorted(alloc.stack.tolist()) == list(range(1, 1001))
