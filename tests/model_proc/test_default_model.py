"""The bundled SmolLM2-135M-Instruct GGUF: converted once, then our greedy
decoding equals transformers' on a real chat prompt."""

from __future__ import annotations

import os
import time

import pytest
import torch

from common.server_args import default_model_path
from model_proc.dtypes import native_bfloat16
from model_proc.weights import resolve_model_path
from tests.helpers import RunnerDriver, hf_greedy, load_hf

NEW_TOKENS = 16


def test_conversion_is_cached(default_model_dir):
    start = time.perf_counter()
    again = resolve_model_path(default_model_path(), os.path.dirname(default_model_dir))
    assert again == default_model_dir and time.perf_counter() - start < 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(default_model_dir))


def test_default_model_greedy_equals_transformers(default_model_dir, make_runner):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)

    runner = make_runner(default_model_path(), max_total_tokens=512, context_length=1024)
    info = runner.model_info
    assert info.model_path == default_model_dir
    assert info.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert (info.vocab_size, info.eos_token_ids) == (49152, [2])
    ours = RunnerDriver(runner).greedy([prompt], NEW_TOKENS)[0]
    del runner
    assert ours == hf_greedy(load_hf(default_model_dir), prompt, NEW_TOKENS), tok.decode(ours)


@pytest.mark.skipif(not native_bfloat16(torch.device("cpu")), reason="no native bfloat16 on this CPU")
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(default_model_dir, make_runner):
    """Our bfloat16 logits stray from float32 no further than transformers'
    bfloat16 do, position by position over a whole answer (teacher-forced on
    the float32 greedy answer, so both see the same tokens); and on a prompt
    whose first answer token is not a near tie, greedy bfloat16 says Paris.
    (Without "Answer in one sentence." the first token is a near tie in
    float32, "The" 25.33 vs "L" 25.24: either dtype's rounding may flip it.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content":
                                    "What is the capital of France? Answer in one sentence."}],
                                  add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    answer = hf_greedy(load_hf(default_model_dir), ids, NEW_TOKENS)
    seq = torch.tensor([ids + answer])
    with torch.inference_mode():
        ref = load_hf(default_model_dir)(seq).logits[0, len(ids) - 1:-1].double()
        hf16 = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
        theirs = hf16(seq).logits[0, len(ids) - 1:-1].double()
    runner = make_runner(default_model_dir, dtype="bfloat16", max_total_tokens=256)
    with torch.inference_mode():
        ours = RunnerDriver(runner).teacher_forced_logits(ids, answer).double()
    our_err = (ours - ref).abs().amax(dim=-1)
    their_err = (theirs - ref).abs().amax(dim=-1)
    assert our_err.median() <= 1.25 * their_err.median(), (our_err, their_err)
    assert our_err.max() <= 1.25 * their_err.max(), (our_err, their_err)
    with torch.inference_mode():
        out = RunnerDriver(runner).greedy([ids], 8)[0]
    assert tok.decode(out).startswith("The capital of France is Paris"), tok.decode(out)
