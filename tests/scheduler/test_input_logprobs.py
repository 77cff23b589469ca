"""Prompt (input) logprobs, computed by the real scheduler and model in one
process, equal transformers' teacher-forced float32 log-softmax over the
prompt: in one prefill, over chunks, with the prefix cache warm, and after a
retraction; each prompt position comes back exactly once."""

from __future__ import annotations

import random

import pytest
import torch

from common.messages import BatchTokenOut, SamplingParams, TokenizedGenerateReq
from tests.helpers import load_hf
from tests.scheduler.test_engine_matches_transformers import Engine
from tokenizer_proc.finish_json import finish_json

MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
_HF: dict[str, object] = {}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@torch.inference_mode()
def _reference(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: log_softmax of each position's float32 logits."""
    if model_dir not in _HF:
        _HF[model_dir] = load_hf(model_dir)
    logits = _HF[model_dir](torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _submit(engine: Engine, rid: str, prompt: list[int], start: int, max_new: int = 3,
            top: int = 0, ignore_eos: bool = True) -> None:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
    engine.sched.process_input_requests([TokenizedGenerateReq(
        rid=rid, input_ids=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=top,
        logprob_start_len=start)])


def _run(engine: Engine) -> None:
    for _ in range(10_000):
        if engine.sched.step() is None and engine.sched.is_idle():
            return
    raise AssertionError("did not finish")


def _input_logprobs(outputs: list[BatchTokenOut], rid: str) -> tuple[list, list]:
    """The prompt logprobs sent for rid: in exactly one message, its first."""
    found = [(m.input_token_logprobs[i], m.input_top_logprobs[i])
             for m in outputs for i, r in enumerate(m.rids) if r == rid]
    assert found and all(not lp for lp, _ in found[1:]), "prompt logprobs in more than one message"
    return found[0]


def _check(model_dir: str, prompt: list[int], start: int, lps: list, tops: list, top: int) -> None:
    ref = _reference(model_dir, prompt)
    assert len(lps) == len(prompt) - start and lps[0] is None
    # entry k is prompt token start + k, predicted by position start + k - 1
    want = [ref[p - 1, prompt[p]].item() for p in range(start + 1, len(prompt))]
    assert lps[1:] == pytest.approx(want, abs=1e-4)
    if top:
        assert len(tops) == len(lps) and tops[0] is None
        for p, pairs in zip(range(start + 1, len(prompt)), tops[1:]):
            vals, ids = ref[p - 1].topk(top)
            assert [v for v, _ in pairs] == pytest.approx(vals.tolist(), abs=1e-4)
            assert [i for _, i in pairs] == ids.tolist()


@MODES
@pytest.mark.parametrize("chunk", [-1, 16], ids=["whole", "chunk16"])
def test_prompt_logprobs_equal_transformers_teacher_forced(tiny_llama_dir, overlap, chunk):
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512,
                    chunked_prefill_size=chunk, disable_overlap_schedule=not overlap)
    prompt = _prompt(0, 70)
    _submit(engine, "all", prompt, 0, top=3)
    _submit(engine, "late", _prompt(1, 40), 23)
    _submit(engine, "none", _prompt(2, 30), -1)  # in the same batch, asks for nothing
    _submit(engine, "last", _prompt(3, 9), 8)  # only the None of the last prompt token
    _run(engine)
    engine.assert_no_leak()
    lps, tops = _input_logprobs(engine.outputs, "all")
    _check(tiny_llama_dir, prompt, 0, lps, tops, 3)
    lps, tops = _input_logprobs(engine.outputs, "late")
    _check(tiny_llama_dir, _prompt(1, 40), 23, lps, tops, 0)
    assert _input_logprobs(engine.outputs, "none") == ([], [])
    assert _input_logprobs(engine.outputs, "last") == ([None], [])


@MODES
def test_a_warm_prefix_cache_still_returns_every_prompt_position(tiny_llama_dir, overlap):
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512, page_size=4,
                    chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    prompt = _prompt(4, 70)
    _submit(engine, "first", prompt, -1)  # fills the cache, asks for no prompt logprobs
    _run(engine)
    _submit(engine, "second", prompt, 0)
    _submit(engine, "from30", prompt, 30)
    _run(engine)
    second = engine.sched  # the cache served at most up to logprob_start_len, in whole pages of 4
    assert second.cache.matched_tokens >= 28
    lps, _ = _input_logprobs(engine.outputs, "second")
    _check(tiny_llama_dir, prompt, 0, lps, [], 0)
    lps, _ = _input_logprobs(engine.outputs, "from30")
    _check(tiny_llama_dir, prompt, 30, lps, [], 0)
    # without prompt logprobs, the same prompt takes all but its last token
    # from the cache: 68 in whole pages, the 69th copied
    before = second.cache.matched_tokens
    _submit(engine, "third", prompt, -1)
    _run(engine)
    assert second.cache.matched_tokens - before == 69
    engine.assert_no_leak()


@MODES
def test_retracted_requests_return_each_prompt_position_once(tiny_llama_dir, overlap):
    # 6 requests of 10 + 30 tokens in a pool of 100: admission at ratio 0.7 (eos
    # may end them) admits three, which then need 3 x 40 > 100: some are
    # retracted and recomputed
    engine = Engine(tiny_llama_dir, max_running_requests=8, max_total_tokens=100, page_size=4,
                    disable_overlap_schedule=not overlap)
    prompts = {f"r{i}": _prompt(10 + i, 10) for i in range(6)}
    for rid, prompt in prompts.items():
        _submit(engine, rid, prompt, 0, max_new=30, top=2, ignore_eos=False)
    _run(engine)
    assert engine.sched.decode.total_retractions >= 1
    engine.assert_no_leak()
    for rid, prompt in prompts.items():
        lps, tops = _input_logprobs(engine.outputs, rid)
        _check(tiny_llama_dir, prompt, 0, lps, tops, 2)


def test_logprob_start_len_at_or_past_the_prompt_is_refused(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, max_running_requests=2, max_total_tokens=256)
    _submit(engine, "past", [5, 6, 7], 3)
    reason = finish_json(engine.outputs[-1].finished_reasons[0])
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "logprob_start_len" in reason["message"]


def test_the_model_head_runs_only_over_the_positions_asked_for(tiny_llama_dir, make_runner):
    from tests.helpers import RunnerDriver

    runner = make_runner(tiny_llama_dir)
    driver = RunnerDriver(runner)
    seen: list[int] = []
    runner.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    a, b = driver.new_row(), driver.new_row()
    prompts = [_prompt(20, 12), _prompt(21, 9)]
    batch = driver.extend([a, b], prompts)
    runner.forward(batch)
    assert seen == [2]  # no row asked: the last token of each row only
    # row b asks for positions 3..7 (predicting its tokens 4..8): 2 + 5 rows of the head
    c, d = driver.new_row(), driver.new_row()
    batch = driver.extend([c, d], prompts)
    batch.return_logprob, batch.top_logprobs_nums = True, [0, 2]
    batch.input_logprob_rows, batch.input_logprob_starts = [1], [3]
    batch.input_logprob_targets = [prompts[1][4:9]]
    result = runner.forward(batch)
    assert seen[-1] == 7
    ref = _reference(tiny_llama_dir, prompts[1])
    assert result.input_token_logprobs[0] == pytest.approx(
        [ref[p, prompts[1][p + 1]].item() for p in range(3, 8)], abs=1e-4)
    assert result.input_top_logprob_ids[0] == [ref[p].topk(2).indices.tolist() for p in range(3, 8)]
    # an entry past the row's new tokens is a malformed batch
    e = driver.new_row()
    bad = driver.extend([e], [prompts[1]])
    bad.input_logprob_rows, bad.input_logprob_starts, bad.input_logprob_targets = [0], [5], [[1] * 5]
    with pytest.raises(ValueError, match="input logprob"):
        runner.forward(bad)


@MODES
def test_token_ids_logprob_equal_transformers_at_every_position(tiny_llama_dir, overlap):
    """SGLang's token_ids_logprob: the chosen ids' logprobs at each prompt
    position from logprob_start_len (over chunks) and at each output token."""
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512, chunked_prefill_size=16,
                    disable_overlap_schedule=not overlap)
    prompt, wanted = _prompt(40, 37), [7, 3, 300, 7]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.sched.process_input_requests([
        TokenizedGenerateReq(rid="ids", input_ids=prompt, sampling_params=sp, return_logprob=True,
                             logprob_start_len=5, token_ids_logprob=wanted),
        TokenizedGenerateReq(rid="plain", input_ids=_prompt(41, 20), sampling_params=sp, return_logprob=True,
                             logprob_start_len=0)])
    _run(engine)
    engine.assert_no_leak()
    rows = [(m.input_token_ids_logprobs[i], m.output_token_ids_logprobs[i], m.new_token_ids[i])
            for m in engine.outputs for i, r in enumerate(m.rids) if r == "ids"]
    inputs = [x for x, _, _ in rows if x]
    assert len(inputs) == 1 and inputs[0][0] is None and len(inputs[0]) == len(prompt) - 5
    output = [v for _, vals, _ in rows for v in vals]
    tokens = [t for _, _, ts in rows for t in ts]
    ref = _reference(tiny_llama_dir, prompt + tokens)
    for p, vals in zip(range(5, len(prompt) - 1), inputs[0][1:]):
        assert vals == pytest.approx(ref[p, wanted].tolist(), abs=1e-4)
    # output token k is sampled at position len(prompt) - 1 + k
    assert len(output) == len(tokens) == 4
    for k, vals in enumerate(output):
        assert vals == pytest.approx(ref[len(prompt) - 1 + k, wanted].tolist(), abs=1e-4)
    assert all(not m.output_token_ids_logprobs[i] and not m.input_token_ids_logprobs[i]
               for m in engine.outputs for i, r in enumerate(m.rids) if r == "plain")


def test_token_ids_logprob_outside_the_vocabulary_is_refused_by_the_scheduler(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, max_running_requests=2, max_total_tokens=256)
    engine.sched.process_input_requests([TokenizedGenerateReq(
        rid="bad", input_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=1), return_logprob=True,
        token_ids_logprob=[3, 10**6])])
    reason = finish_json(engine.outputs[-1].finished_reasons[0])
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "token_ids_logprob" in reason["message"]
