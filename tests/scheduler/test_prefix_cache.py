"""The prefix cache in the scheduler, driven by the fake model whose "KV" is a
fingerprint of the sequence (tests/scheduler/fake_model.py): a prefix taken
from the wrong sequence, or a slot overwritten while someone still reads it,
fails the model's own check or changes the tokens."""

from __future__ import annotations

import random

import pytest

from common.messages import AbortReq, BatchTokenOut, FlushCacheQuery, SamplingParams, StateQuery, TokenizedGenerateReq
from common.server_args import ServerArgs
from scheduler_proc.create import create_scheduler
from scheduler_proc.kv_invariant import check_kv_invariant
from tests.scheduler.fake_model import FakeModel, fake_model_info
from tests.scheduler.test_scheduler import MODES, assert_no_leak
from tokenizer_proc.finish_json import finish_json


class CacheHarness:
    def __init__(self, max_total_tokens: int = 4096, max_running: int = 8, context_len: int = 512,
                 eos_one_in: int = 0, **args) -> None:
        args.setdefault("enable_mixed_chunk", False)  # the plain loop, step by step
        args.setdefault("page_size", 1)  # tokens counted one by one, unless a test gives pages
        self.model = FakeModel(eos_one_in, content_dependent=True, max_total_tokens=max_total_tokens)
        self.outputs: list[BatchTokenOut] = []
        self.sched = create_scheduler(ServerArgs(model_path="fake", max_running_requests=max_running, **args),
                                      fake_model_info(max_total_tokens, context_len), self.model,
                                      self.outputs.append)

    def submit(self, rid: str, ids: list[int], max_new: int, salt: str = "", ignore_eos: bool = False) -> None:
        self.sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=ids, cache_salt=salt,
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                           ignore_eos=ignore_eos))])

    def step(self) -> object:
        batch = self.sched.step()
        assert check_kv_invariant(self.sched.cache) is None, check_kv_invariant(self.sched.cache)
        return batch

    def run_until_idle(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if self.step() is None and self.sched.is_idle():
                return
        raise AssertionError("scheduler did not go idle")

    def field(self, rid: str, name: str) -> object:
        """A per-row field of the request's final BatchTokenOut row."""
        for m in self.outputs:
            for i, r in enumerate(m.rids):
                if r == rid and m.finished_reasons[i] is not None:
                    return getattr(m, name)[i]
        raise KeyError(rid)

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.outputs for r, ts in zip(m.rids, m.new_token_ids) if r == rid for t in ts]

    def state(self) -> dict:
        replies: list = []
        send, self.sched.send_output = self.sched.send_output, replies.append
        self.sched.process_input_requests([StateQuery(query_id="q")])
        self.sched.send_output = send
        return replies[0].data


SYSTEM = list(range(100, 164))  # a 64-token shared prefix


def test_a_second_request_with_the_same_prefix_computes_only_its_own_tokens():
    h = CacheHarness()
    h.submit("a", SYSTEM + [1, 2, 3], max_new=4)
    h.run_until_idle()
    h.submit("b", SYSTEM + [7, 8], max_new=4)
    batch = h.step()
    assert batch.forward_mode == "extend" and batch.prefix_lens == [64]
    assert batch.input_ids == [7, 8]  # only what the cache did not hold
    h.run_until_idle()
    assert h.field("a", "cached_tokens") == 0
    assert h.field("b", "cached_tokens") == 64
    assert_no_leak(h.sched)


def test_a_second_chat_turn_reuses_the_first_turns_prompt_and_answer():
    h = CacheHarness()
    turn1 = SYSTEM + [5, 6, 7]
    h.submit("t1", turn1, max_new=10)
    h.run_until_idle()
    answer = h.tokens("t1")
    h.submit("t2", turn1 + answer + [9, 9, 9], max_new=5)
    h.run_until_idle()
    # everything the first turn computed is reused: its prompt and its output
    # (but the last output token, whose KV nobody computed)
    assert h.field("t2", "cached_tokens") >= len(turn1) + len(answer) - 1
    ref = CacheHarness(disable_radix_cache=True)
    ref.submit("t2", turn1 + answer + [9, 9, 9], max_new=5)
    ref.run_until_idle()
    assert h.tokens("t2") == ref.tokens("t2")
    assert_no_leak(h.sched)


def test_the_whole_prompt_is_never_matched_the_last_token_is_computed():
    h = CacheHarness()
    h.submit("a", SYSTEM, max_new=3)
    h.run_until_idle()
    h.submit("b", SYSTEM, max_new=3)
    batch = h.step()
    assert batch.prefix_lens == [63] and batch.input_ids == [SYSTEM[-1]]
    h.run_until_idle()
    assert h.tokens("a") == h.tokens("b")
    assert_no_leak(h.sched)


def test_requests_with_different_salts_never_share_a_prefix():
    h = CacheHarness()
    h.submit("a", SYSTEM + [1], max_new=2, salt="tenant-a")
    h.run_until_idle()
    h.submit("b", SYSTEM + [2], max_new=2, salt="tenant-b")
    h.submit("c", SYSTEM + [3], max_new=2)  # no salt: not tenant-a's either
    h.run_until_idle()
    assert h.field("b", "cached_tokens") == 0 and h.field("c", "cached_tokens") == 0
    h.submit("d", SYSTEM + [4], max_new=2, salt="tenant-a")
    h.run_until_idle()
    assert h.field("d", "cached_tokens") == 64
    assert_no_leak(h.sched)


def test_flush_cache_empties_the_tree_and_is_refused_while_requests_run():
    h = CacheHarness()
    h.submit("a", SYSTEM, max_new=3)
    h.step()
    replies: list = []
    h.sched.send_output = replies.append
    h.sched.process_input_requests([FlushCacheQuery(query_id="busy")])
    assert not replies[-1].ok
    h.run_until_idle()
    h.sched.send_output = h.outputs.append
    assert h.state()["evictable_kv_slots"] == 66  # 64 prompt tokens + 2 of the 3 output tokens
    h.sched.send_output = replies.append
    h.sched.process_input_requests([FlushCacheQuery(query_id="idle")])
    assert replies[-1].ok
    h.sched.send_output = h.outputs.append
    state = h.state()
    assert state["evictable_kv_slots"] == 0 and state["free_kv_slots"] == state["total_kv_slots"]
    assert state["radix_tree_nodes"] == 0


@MODES
def test_chunked_prefill_inserts_each_chunk_so_a_later_request_shares_it(overlap):
    h = CacheHarness(chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    long = list(range(200, 264))
    h.submit("long", long, max_new=3)
    h.step()  # chunk 1 (16 tokens)
    h.step()  # chunk 2: chunk 1 goes into the tree first
    h.submit("twin", long[:20] + [5], max_new=3)
    h.run_until_idle()
    assert h.field("twin", "cached_tokens") >= 16
    assert h.field("long", "cached_tokens") == 0  # its own chunks are not "cached" for it
    ref = CacheHarness(disable_radix_cache=True)
    ref.submit("twin", long[:20] + [5], max_new=3)
    ref.run_until_idle()
    assert h.tokens("twin") == ref.tokens("twin")
    assert_no_leak(h.sched)


@MODES
def test_abort_and_retraction_free_only_the_requests_own_tail(overlap):
    h = CacheHarness(disable_overlap_schedule=not overlap)
    h.submit("seed", SYSTEM + [1], max_new=2)
    h.run_until_idle()
    cached = h.state()["evictable_kv_slots"]
    h.submit("a", SYSTEM + [2, 3], max_new=50)
    h.step()
    h.step()
    h.sched.process_input_requests([AbortReq(rid="a")])
    state = h.state()
    # a's prompt went into the cache after its prefill and is evictable now;
    # its decoded tokens were its own and are free; nothing is held
    assert state["evictable_kv_slots"] == cached + 2 and state["protected_kv_slots"] == 0
    assert state["held_kv_slots"] == 0
    h.run_until_idle()
    assert_no_leak(h.sched)


def test_static_and_dynamic_batching_run_without_the_cache_and_say_so():
    for mode in ("static", "dynamic"):
        h = CacheHarness(batching=mode, batch_timeout_ms=0.0)
        h.submit("a", SYSTEM, max_new=2)
        h.run_until_idle()
        h.submit("b", SYSTEM, max_new=2)
        h.run_until_idle()
        assert h.field("b", "cached_tokens") == 0
        assert h.state()["radix_cache"] is False
        assert_no_leak(h.sched)
    assert CacheHarness().state()["radix_cache"] is True
    assert CacheHarness(disable_radix_cache=True).state()["radix_cache"] is False


def random_workload(rng: random.Random, context_len: int) -> list[tuple[int, str, list[int], int, str]]:
    """(arrival step, rid, prompt, max_new, salt): groups sharing system
    prompts, multi-turn-like extensions of earlier prompts, and loners."""
    systems = [[rng.randint(10, 999) for _ in range(rng.randint(4, 40))] for _ in range(rng.randint(1, 4))]
    out: list[tuple[int, str, list[int], int, str]] = []
    prompts: list[list[int]] = []
    for i in range(rng.randint(6, 30)):
        kind = rng.random()
        if kind < 0.6:
            base = rng.choice(systems)
        elif kind < 0.8 and prompts:
            base = rng.choice(prompts)
        else:
            base = []
        prompt = (base + [rng.randint(10, 999) for _ in range(rng.randint(1, 20))])[:context_len // 2]
        prompts.append(prompt)
        salt = rng.choice(["", "", "", "x"])
        out.append((rng.randint(0, 60), f"r{i}", prompt, rng.randint(1, 30), salt))
    return out


# the runs without the cache, by (page size, seed): computed once for both modes
_REFERENCE_TOKENS: dict[tuple[int, int], dict[str, list[int]]] = {}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@MODES
def test_random_shared_prefix_loads_give_the_outputs_of_a_run_without_cache(overlap, page_size):
    """Property: random shared-prefix workloads, pools from smaller than the
    cached tree (eviction) to roomy, chunking, EOS, retraction and aborts,
    with a slot per token and with pages of several (where a match that ends
    inside a page copies its rows: the fake model checks every copied row's
    fingerprint). The accounts add up after every step (each request's own
    pages filled in order), the fake model's KV check never fails, nothing
    leaks, every finished request's tokens equal the run without the cache,
    and an aborted one's are a prefix of them."""
    copied = 0
    for seed in range(25):
        rng = random.Random(seed)
        context_len = 256
        load = random_workload(rng, context_len)
        need = max(len(p) + m for _, _, p, m, _ in load)
        pool = rng.randint(need, 600) + page_size - 1  # the longest request fits in whole pages
        common = dict(max_total_tokens=pool, max_running=rng.randint(1, 10), context_len=context_len,
                      page_size=page_size,
                      eos_one_in=rng.choice([0, 7, 25]), chunked_prefill_size=rng.choice([-1, 8, 32]),
                      schedule_policy=rng.choice(["fcfs", "lpm"]))
        key = (page_size, seed)  # the reference run, the same for both modes: run once
        if key not in _REFERENCE_TOKENS:
            ref = CacheHarness(disable_radix_cache=True, disable_overlap_schedule=True, **common)
            for _, rid, prompt, max_new, salt in load:
                ref.submit(rid, prompt, max_new, salt)
            ref.run_until_idle()
            _REFERENCE_TOKENS[key] = {rid: ref.tokens(rid) for _, rid, *_ in load}
        ref_tokens = _REFERENCE_TOKENS[key]

        h = CacheHarness(disable_overlap_schedule=not overlap, **common)
        aborts = {rid: rng.randint(0, 80) for _, rid, *_ in load if rng.random() < 0.15}
        step = 0
        while True:
            for t, rid, prompt, max_new, salt in load:
                if t == step:
                    h.submit(rid, prompt, max_new, salt)
            for rid, t in aborts.items():
                if t == step:
                    h.sched.process_input_requests([AbortReq(rid=rid)])
            if h.step() is None and step > 80 and h.sched.is_idle():
                break
            step += 1
            assert step < 20_000, f"seed {seed}: never went idle"
        for _, rid, *_ in load:
            reason = finish_json(h.field(rid, "finished_reasons"))
            want = ref_tokens[rid]
            if reason["type"] == "abort":
                assert want[:len(h.tokens(rid))] == h.tokens(rid), f"seed {seed}, {rid}"
            else:
                assert h.tokens(rid) == want, f"seed {seed}, {rid}: {reason}"
        assert_no_leak(h.sched)
        copied += h.model.copied_rows
    assert page_size == 1 or copied > 300, "the loads must copy rows of partly matched pages"


def test_the_property_load_does_hit_the_cache_evict_and_retract():
    """The property test above is only as good as its loads: across its seeds
    they reuse prefixes, evict and retract."""
    hits = evictions = retractions = 0
    for seed in range(25):
        rng = random.Random(seed)
        load = random_workload(rng, 256)
        need = max(len(p) + m for _, _, p, m, _ in load)
        pool = rng.randint(need, 600)
        h = CacheHarness(max_total_tokens=pool, max_running=rng.randint(1, 10), context_len=256,
                         eos_one_in=rng.choice([0, 7, 25]), chunked_prefill_size=rng.choice([-1, 8, 32]))
        evict = h.sched.cache.tree.evict
        counted = [0]

        def counting_evict(n: int) -> int:
            freed = evict(n)
            counted[0] += freed
            return freed
        h.sched.cache.tree.evict = counting_evict  # type: ignore[method-assign]
        for _, rid, prompt, max_new, salt in load:
            h.submit(rid, prompt, max_new, salt)
        h.run_until_idle()
        hits += h.sched.cache.matched_tokens
        evictions += counted[0]
        retractions += h.sched.decode.total_retractions
    assert hits > 1000 and evictions > 100 and retractions > 0, (hits, evictions, retractions)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_n_requests_of_one_prompt_compute_it_once_when_they_arrive_apart(policy):
    h = CacheHarness(schedule_policy=policy)
    h.submit("first", SYSTEM + [1], max_new=3)
    h.step()
    h.step()  # its prefill's result is read (with overlap, during this step): its prompt is cached
    for i in range(4):
        h.submit(f"n{i}", SYSTEM + [1], max_new=2)
    h.run_until_idle()
    assert all(h.field(f"n{i}", "cached_tokens") == 64 for i in range(4))
    assert_no_leak(h.sched)


@MODES
def test_requests_arriving_together_compute_a_shared_prefix_once(overlap):
    """Two requests with the same system prompt arrive at once: the second
    waits one batch and takes the prompt from the cache instead of computing
    it in the same batch; a request that shares nothing is not held back."""
    h = CacheHarness(disable_overlap_schedule=not overlap)
    h.submit("a", SYSTEM + [1, 2], max_new=3)
    h.submit("b", SYSTEM + [3, 4], max_new=3)
    h.submit("c", list(range(600, 640)), max_new=3)
    first = h.step()
    assert [r.rid for r in first.reqs] == ["a", "c"]
    second = h.step()
    assert second.forward_mode == "extend" and [r.rid for r in second.reqs] == ["b"]
    assert second.prefix_lens == [64]
    h.run_until_idle()
    assert h.field("b", "cached_tokens") == 64
    assert_no_leak(h.sched)


# ---- pages of 16: a match that ends inside a page is copied ---------------------------

@MODES
@pytest.mark.parametrize("length", [6, 35, 82])
def test_with_pages_of_16_a_repeated_prompt_reuses_all_but_its_last_token(overlap, length):
    """SGLang's expectation (page size 1): cached_tokens = prompt - 1. With
    pages of 16 the whole pages are shared and the rows of the page the
    match ends in are copied into the request's own first page."""
    h = CacheHarness(page_size=16, disable_overlap_schedule=not overlap)
    prompt = list(range(300, 300 + length))
    h.submit("a", prompt, max_new=5)
    h.run_until_idle()
    h.submit("b", prompt, max_new=5)
    batch = h.step()
    rows = (length - 1) % 16
    assert batch.prefix_lens == [length - 1] and batch.input_ids == [prompt[-1]]
    assert len(batch.kv_copy_src) == rows and len(batch.kv_copy_dst) == rows
    h.run_until_idle()
    assert h.field("b", "cached_tokens") == length - 1
    assert h.tokens("b") == h.tokens("a")  # the fake model's tokens depend on every row's fingerprint
    assert h.model.copied_rows == rows
    assert_no_leak(h.sched)


@MODES
def test_with_pages_of_16_a_second_chat_turn_reuses_the_first_turn_to_the_token(overlap):
    h = CacheHarness(page_size=16, disable_overlap_schedule=not overlap)
    turn1 = list(range(100, 135))  # 35 tokens
    h.submit("t1", turn1, max_new=10)
    h.run_until_idle()
    answer = h.tokens("t1")
    turn2 = turn1 + answer + [9, 9, 9]
    h.submit("t2", turn2, max_new=5)
    h.run_until_idle()
    # everything the first turn computed: its prompt and its output but the
    # last output token (nobody computed its KV), whole pages or not
    assert h.field("t2", "cached_tokens") == len(turn1) + len(answer) - 1
    ref = CacheHarness(page_size=16, disable_radix_cache=True)
    ref.submit("t2", turn2, max_new=5)
    ref.run_until_idle()
    assert h.tokens("t2") == ref.tokens("t2")
    assert_no_leak(h.sched)


def test_the_page_copied_from_stays_locked_until_the_copy_is_sent_then_becomes_evictable():
    h = CacheHarness(page_size=16)
    prompt = list(range(300, 306))
    h.submit("a", prompt, max_new=3)
    h.run_until_idle()
    tree = h.sched.cache.tree
    assert (tree.evictable_size, tree.protected_size) == (16, 0)  # a's 8 tokens: a partial leaf
    h.submit("b", prompt, max_new=3)
    req = h.sched.queue.waiting[0]
    match = h.sched.cache.match(req)
    assert match.length == 5 and match.copy_node is not None
    h.sched.cache.admit(req, match)
    assert tree.protected_size == 16  # the source page: eviction cannot take it now
    assert check_kv_invariant(h.sched.cache) is None
    src, dst = h.sched.cache.take_kv_copies([req])
    assert len(src) == len(dst) == 5 and tree.protected_size == 0
    h.sched.cache.release(req, cache=False)
    assert check_kv_invariant(h.sched.cache) is None


def test_a_new_turn_supersedes_the_partial_page_it_copied_from():
    """A request that copied a partial leaf's rows and goes past them puts its
    own page in the tree: the partial leaf is dropped, not kept twice."""
    h = CacheHarness(page_size=16)
    first = list(range(300, 306))
    h.submit("a", first, max_new=3)  # 8 tokens with KV in the tree
    h.run_until_idle()
    h.submit("b", first + h.tokens("a")[:2] + [7] * 18, max_new=3)
    h.run_until_idle()
    assert h.field("b", "cached_tokens") == 8
    tree = h.sched.cache.tree
    assert tree.evictable_size == 32  # b's 28 tokens in two pages; a's partial page is gone
    assert_no_leak(h.sched)
