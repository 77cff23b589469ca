"""Penalties end to end on the real tiny model (scheduler + model runner in one
process), greedy, against a reference that recomputes transformers' logits for
the whole sequence at every step and penalizes them directly: transformers'
RepetitionPenaltyLogitsProcessor, OpenAI's frequency/presence formula,
logit_bias, min_new_tokens. Under load, in a pool small enough to retract
rows, with the overlap schedule on and off."""

from __future__ import annotations

import functools
import random

import msgspec
import pytest
import torch

from common.messages import SamplingParams, TokenizedGenerateReq
from tests.helpers import hf_last_logits, load_hf
from tests.scheduler.test_engine_matches_transformers import Engine
from tokenizer_proc.finish_json import finish_json

EOS = 2  # the tiny model's
MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
_REFERENCE: dict[tuple, list[int]] = {}  # computed once for both modes


@functools.lru_cache(maxsize=1)
def _hf(model_dir: str):
    return load_hf(model_dir)


def reference(model_dir: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    key = (model_dir, tuple(prompt), msgspec.msgpack.encode(sp))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference(_hf(model_dir), prompt, sp)
    return _REFERENCE[key]


@torch.inference_mode()
def _reference(model, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Greedy with the penalties applied to transformers' float32 logits, one
    penalty at a time, each written from its definition."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    stops = set(sp.stop_token_ids) | ({EOS} if not sp.ignore_eos else set())
    while len(out) < sp.max_new_tokens:
        logits = hf_last_logits(model, prompt + out)[None, :].clone()
        if sp.repetition_penalty != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(
                torch.tensor([prompt + out]), logits)
        for tok in set(out):  # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence
            logits[0, tok] -= out.count(tok) * sp.frequency_penalty + sp.presence_penalty
        for tok, b in sp.logit_bias.items():
            logits[0, tok] += b
        if len(out) < sp.min_new_tokens:
            for tok in stops:
                logits[0, tok] = float("-inf")
        out.append(int(logits[0].argmax()))
        if out[-1] in stops:
            break
    return out


PENALTIES = [
    {},
    {"repetition_penalty": 1.6},
    {"repetition_penalty": 0.6},
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"presence_penalty": -2.0},
    {"logit_bias": {7: 4.0, 100: -50.0, 300: 2.5}},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": 0.3,
     "logit_bias": {11: 3.0}, "min_new_tokens": 4},
]


def run(model_dir: str, reqs, **args) -> Engine:
    engine = Engine(model_dir, ignore_eos=False, **args)
    for rid, prompt, sp in reqs:
        engine.sched.process_input_requests([TokenizedGenerateReq(rid=rid, input_ids=prompt,
                                                                  sampling_params=sp)])
        engine.reqs[rid] = engine.sched.queue.by_rid[rid]
    engine.run({0: []})
    engine.assert_no_leak()
    return engine


@MODES
def test_penalized_greedy_outputs_equal_the_reference_under_retraction(tiny_llama_dir, overlap):
    rng = random.Random(3)
    reqs = []
    for i in range(24):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(5, 20))]
        reqs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=30, temperature=0.0,
                                                     **PENALTIES[i % len(PENALTIES)])))
    engine = run(tiny_llama_dir, reqs, max_running_requests=24, max_total_tokens=150,
                 disable_overlap_schedule=not overlap)
    penalized = [rid for rid, _, sp in reqs if sp.penalized()]
    assert any(engine.reqs[rid].num_retractions for rid in penalized)  # rebuilt after a retraction
    for rid, prompt, sp in reqs:
        assert engine.reqs[rid].output_ids == reference(tiny_llama_dir, prompt, sp), (rid, sp)


@MODES
def test_min_new_tokens_holds_back_a_forced_eos_and_stop_token_exactly_that_long(tiny_llama_dir,
                                                                                overlap):
    prompt = [5, 80, 44, 301, 17]
    forced_eos = SamplingParams(max_new_tokens=20, temperature=0.0, logit_bias={EOS: 100.0})
    reqs = [
        ("eos-now", prompt, forced_eos),  # without min_new_tokens: EOS at once
        ("eos-after-5", prompt, SamplingParams(max_new_tokens=20, temperature=0.0,
                                               logit_bias={EOS: 100.0}, min_new_tokens=5)),
        ("stop-id-after-3", prompt, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[9],
                                                   logit_bias={9: 100.0}, min_new_tokens=3)),
        ("min-equals-max", prompt, SamplingParams(max_new_tokens=4, temperature=0.0,
                                                  logit_bias={EOS: 100.0}, min_new_tokens=4)),
    ]
    engine = run(tiny_llama_dir, reqs, max_running_requests=4, disable_overlap_schedule=not overlap)
    out = {rid: engine.reqs[rid] for rid, _, _ in reqs}
    assert out["eos-now"].output_ids == [EOS]
    assert len(out["eos-after-5"].output_ids) == 6 and out["eos-after-5"].output_ids[-1] == EOS
    assert EOS not in out["eos-after-5"].output_ids[:5]
    assert finish_json(out["eos-after-5"].finish) == {"type": "stop", "matched": EOS}
    assert len(out["stop-id-after-3"].output_ids) == 4
    assert finish_json(out["stop-id-after-3"].finish) == {"type": "stop", "matched": 9}
    assert finish_json(out["min-equals-max"].finish) == {"type": "length", "length": 4}
    assert EOS not in out["min-equals-max"].output_ids
    for rid, p, sp in reqs:
        assert out[rid].output_ids == reference(tiny_llama_dir, p, sp), rid
