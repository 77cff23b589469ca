"""The engine (the real scheduler driving the real model, in one process)
generates, token for token, what transformers' greedy `generate` does, while
requests arrive at different steps, so rows join and leave mid-flight; with
the overlap schedule on and off."""

from __future__ import annotations

import random

import pytest
import torch

from common.messages import BatchTokenOut, SamplingParams, TokenizedGenerateReq
from common.server_args import ServerArgs
from model_proc.runner import ModelRunner
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.scheduler import Scheduler
from tests.helpers import greedy_parting, hf_greedy_with_top, load_hf
from tests.scheduler.test_scheduler import assert_no_leak
from tokenizer_proc.finish_json import finish_json

MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
# transformers' reference outputs, computed once for both modes
_REFERENCE_CACHE: dict[tuple, tuple[list[int], list[list[int]]]] = {}


class Engine:
    """Scheduler + ModelRunner wired directly; outputs collected per rid."""

    def __init__(self, model_path: str, ignore_eos: bool = True, **args) -> None:
        self.ignore_eos = ignore_eos
        args.setdefault("dtype", "float32")  # compared with transformers in float32
        server_args = ServerArgs(model_path=model_path, **args)
        self.runner = ModelRunner(server_args)
        self.outputs: list[BatchTokenOut] = []
        self.sched = Scheduler(server_args, self.runner.model_info, self.runner,
                               self.outputs.append)
        self.reqs: dict = {}

    def submit(self, rid: str, prompt: list[int], max_new_tokens: int) -> None:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            ignore_eos=self.ignore_eos)
        self.sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=5)])
        self.reqs[rid] = self.sched.queue.by_rid[rid]

    def run(self, arrivals: dict[int, list[tuple[str, list[int], int]]]) -> list[int]:
        """arrivals: step number -> requests submitted before that step. Returns
        the running-batch size seen at each decode step."""
        sizes, step = [], 0
        while True:
            for rid, prompt, n in arrivals.get(step, []):
                self.submit(rid, prompt, n)
            batch = self.sched.step()
            if batch is None and step > max(arrivals) and self.sched.is_idle():
                return sizes
            if batch is not None and batch.forward_mode == "decode":
                sizes.append(len(batch))
            step += 1
            assert step < 10_000

    def assert_no_leak(self) -> None:
        s = self.sched
        assert_no_leak(s)
        assert not s.queue.by_rid and not s.queue.waiting and s.decode.running_batch is None


def check_against_transformers(engine: Engine, model_dir: str, arrivals) -> list[str]:
    partings = []
    hf_model = None
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            req = engine.reqs[rid]
            assert finish_json(req.finish) == {"type": "length", "length": n}
            assert len(req.output_ids) == len(req.output_token_logprobs) == n
            ours_top = [[tok for _, tok in top] for top in req.output_top_logprobs]
            key = (model_dir, tuple(prompt), n)
            if key not in _REFERENCE_CACHE:
                hf_model = hf_model or load_hf(model_dir)
                _REFERENCE_CACHE[key] = hf_greedy_with_top(hf_model, prompt, n)
            ref, ref_top = _REFERENCE_CACHE[key]
            pos = greedy_parting(req.output_ids, ours_top, ref, ref_top)
            if pos is not None:
                partings.append(f"{rid} parts from transformers at a near-tie, position {pos}")
    return partings


@MODES
def test_tiny_model_engine_equals_transformers_with_rows_joining_and_leaving(tiny_llama_dir,
                                                                           overlap):
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    # lengths and arrival steps chosen so that rows finish at different steps,
    # later arrivals are prefilled while others decode, and the queue backs up
    arrivals = {
        0: [("a", prompt(5), 12), ("b", prompt(17), 3)],
        2: [("c", prompt(1), 9)],
        4: [("d", prompt(30), 6), ("e", prompt(8), 15), ("f", prompt(3), 1)],
        9: [("g", prompt(11), 7)],
        15: [("h", prompt(2), 4)],
    }
    engine = Engine(tiny_llama_dir, max_running_requests=3, max_total_tokens=256,
                    disable_overlap_schedule=not overlap)
    sizes = engine.run(arrivals)
    assert max(sizes) == 3 and min(sizes) == 1  # the batch grew and shrank
    engine.assert_no_leak()
    partings = check_against_transformers(engine, tiny_llama_dir, arrivals)
    # wide random weights leave no near-ties: any parting would be a bug
    assert not partings, partings


@MODES
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_tiny_model_engine_with_mixed_steps_equals_transformers(tiny_llama_dir, overlap, backend):
    """--enable-mixed-chunk: running rows decode inside the prefill steps (on
    the native backend through its decode kernel, on torch as extend rows)."""
    rng = random.Random(1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    arrivals = {0: [("a", prompt(5), 14)], 2: [("b", prompt(40), 6)], 4: [("c", prompt(9), 9)],
                5: [("d", prompt(70), 5), ("e", prompt(2), 8)], 11: [("f", prompt(33), 4)]}
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512, chunked_prefill_size=32,
                    enable_mixed_chunk=True, attention_backend=backend, disable_overlap_schedule=not overlap)
    engine.run(arrivals)
    assert engine.sched.decode.num_mixed_steps >= 3
    engine.assert_no_leak()
    partings = check_against_transformers(engine, tiny_llama_dir, arrivals)
    assert not partings, partings


@MODES
def test_default_model_engine_equals_transformers_with_rows_joining_and_leaving(default_model_dir,
                                                                              overlap):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)

    def chat(question: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    arrivals = {
        0: [("france", chat("What is the capital of France?"), 16),
            ("count", tok.encode("1, 2, 3, 4,"), 4)],
        3: [("poem", chat("Write a haiku about the sea."), 8)],
        6: [("story", tok.encode("Once upon a time, there was a"), 5)],
    }
    engine = Engine(default_model_dir, max_running_requests=4, max_total_tokens=1024,
                    context_length=1024, disable_overlap_schedule=not overlap)
    sizes = engine.run(arrivals)
    assert max(sizes) >= 3 and min(sizes) == 1
    engine.assert_no_leak()
    del engine.runner
    partings = check_against_transformers(engine, default_model_dir, arrivals)
    for p in partings:  # allowed, but reported
        print(p)
    assert "Paris" in tok.decode(engine.reqs["france"].output_ids)


def staggered_arrivals(seed: int) -> dict[int, list[tuple[str, list[int], int]]]:
    """Rows joining and leaving, two prompts longer than a 32-token prefill
    chunk (so chunked), one arriving while others decode."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    return {0: [("a", prompt(6), 10), ("b", prompt(45), 4)], 2: [("c", prompt(2), 8)],
            5: [("d", prompt(70), 5), ("e", prompt(9), 7)]}


@MODES
@pytest.mark.parametrize("model", ["qwen3", "phi3"])
def test_qwen3_and_phi3_engines_equal_transformers_with_staggered_requests(model, overlap, request):
    """The other families through the real scheduler: Qwen3's q/k norms and
    Phi-3's split checkpoint tensors, with chunked prefill."""
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    arrivals = staggered_arrivals(2)
    engine = Engine(folder, max_running_requests=3, max_total_tokens=512, chunked_prefill_size=32,
                    disable_overlap_schedule=not overlap)
    sizes = engine.run(arrivals)
    assert max(sizes) == 3 and min(sizes) == 1
    engine.assert_no_leak()
    partings = check_against_transformers(engine, folder, arrivals)
    assert not partings, partings


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("model", ["gemma3", "gemma2", "mistral"])
def test_sliding_window_engines_equal_transformers_with_chunks_cache_and_retraction(model, backend, request):
    """Sliding-window families (window 16, tests/conftest.py) through the
    real scheduler: prompts longer than the window prefilled in 32-token
    chunks, later requests extending a cached prefix past the window, and a
    pool small enough that rows are retracted and recomputed."""
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    rng = random.Random(4)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    shared = prompt(48)
    arrivals = {0: [("a", shared + prompt(5), 24), ("b", prompt(40), 20)], 3: [("c", prompt(3), 30)],
                8: [("d", shared + prompt(9), 20), ("e", shared[:40] + prompt(2), 25)]}
    engine = Engine(folder, max_running_requests=4, max_total_tokens=128, page_size=4, chunked_prefill_size=32,
                    attention_backend=backend)
    engine.run(arrivals)
    assert engine.sched.decode.total_retractions >= 1
    assert sum(engine.reqs[r].cache_hit_tokens for r in "de") >= 32  # the shared prefix came from the cache
    engine.assert_no_leak()
    partings = check_against_transformers(engine, folder, arrivals)
    assert not partings, partings


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_window_pool_bounds_sliding_layers_kv_and_the_engine_still_equals_transformers(backend, tiny_gemma3_dir):
    """Gemma 3's sliding layers (window 16) keep their K/V in a window pool of
    112 slots (--swa-full-tokens-ratio 0.1 of a 1024-token pool, raised to
    what 3 running windows and a 32-token chunk need) while the running
    requests hold over twice that in the full pool: a request's sliding-layer
    KV is bounded by its window, not its length. Prompts longer than the
    window go in chunks, a request starts from another's cached prefix
    while its window pages are still held, and the greedy tokens equal
    transformers'."""
    rng = random.Random(5)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    shared = prompt(100)
    first = shared + prompt(30)
    arrivals = {0: [("a", first, 40)], 6: [("d", first + prompt(6), 20)],
                8: [("b", prompt(110), 30), ("c", prompt(70), 45)]}
    engine = Engine(tiny_gemma3_dir, max_running_requests=3, max_total_tokens=1024, page_size=4,
                    chunked_prefill_size=32, swa_full_tokens_ratio=0.1, attention_backend=backend)
    cache = engine.sched.cache
    assert cache.window_pool is not None and cache.window_pool.size == 112
    peak_full = 0
    step = engine.sched.step

    def step_and_measure():
        nonlocal peak_full
        batch = step()
        peak_full = max(peak_full, cache.size - cache.allocator.available() - cache.tree.evictable_size)
        assert (error := check_kv_invariant(cache)) is None, error
        return batch
    engine.sched.step = step_and_measure
    engine.run(arrivals)
    assert peak_full > 2 * cache.window_pool.size
    assert engine.reqs["d"].cache_hit_tokens >= 120
    engine.assert_no_leak()
    partings = check_against_transformers(engine, tiny_gemma3_dir, arrivals)
    assert not partings, partings


def test_qwen3_bfloat16_on_the_native_backend_runs_the_modules_and_equals_transformers(tiny_qwen3_dir,
                                                                                     tiny_llama_dir):
    """The fused native decoder has no q/k-norm step: for Qwen3 it declines
    (where it would run a Llama) and the modules' forward answers, in
    bfloat16 up to a near-tie parting from transformers' float32."""
    from model_proc import native
    from model_proc.layers import native_layers_op

    args = dict(dtype="bfloat16", attention_backend="native", max_running_requests=3, max_total_tokens=512,
                chunked_prefill_size=32)
    # where the native ops run (AMX or AVX512_BF16 brgemm); elsewhere no model gets the native decoder
    if native.load() is not None and native_layers_op(torch.device("cpu")) is not None:
        assert ModelRunner(ServerArgs(model_path=tiny_llama_dir, **args)).model.native_decoder is not None
    engine = Engine(tiny_qwen3_dir, **args)
    assert engine.runner.model.native_decoder is None
    arrivals = staggered_arrivals(3)
    engine.run(arrivals)
    engine.assert_no_leak()
    for p in check_against_transformers(engine, tiny_qwen3_dir, arrivals):  # allowed, but reported
        print(p)
