"""Prompt logprobs through a real server (tiny random model, float32, the
default model's tokenizer): /generate's input_token_logprobs and
/v1/completions' echo equal transformers' teacher-forced log-softmax, with
chunked prefill and the prefix cache warm."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from tests.e2e.server_process import ServerProcess
from tests.helpers import load_hf

PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(40)]  # inside the tiny model's 512-token vocabulary


@pytest.fixture(scope="module")
def server(tiny_llama_dir, default_model_dir):
    srv = ServerProcess("--model-path", tiny_llama_dir, "--tokenizer-path", default_model_dir,
                        "--dtype", "float32", "--chunked-prefill-size", "16", "--max-total-tokens", "1024")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[float]:
    """The logprob of prompt token p (p >= 1) as position p - 1 predicts it."""
    with torch.inference_mode():
        logits = load_hf(tiny_llama_dir)(torch.tensor([PROMPT])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))]


def test_generate_returns_every_prompt_logprob_twice_over_a_warm_cache(server, reference):
    for _ in range(2):  # the second time the prompt is cached: still every position
        r = requests.post(server.url + "/generate", json={
            "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=120)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == PROMPT and entries[0][0] is None
        assert [e[0] for e in entries[1:]] == pytest.approx(reference, abs=1e-4)
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT)
        assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    r = requests.post(server.url + "/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT)}, timeout=30)
    assert r.status_code == 400 and "logprob_start_len" in r.text


def test_completions_echo_returns_the_prompt_logprobs(server, reference):
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(reference, abs=1e-4)
    assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0


def test_max_new_tokens_0_scores_the_prompt_and_returns_no_token(server, reference):
    """SGLang's prefill-only request: its prompt logprobs, finish_reason length
    0, no output; streamed, one final event with the same."""
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(reference, abs=1e-4)
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == "" and last["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[0] for e in last["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(reference, abs=1e-4)
    r = requests.post(server.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
                      timeout=30)
    assert r.status_code == 400 and "max_new_tokens must be >= 0" in r.text


def test_streamed_output_token_logprobs_length_counts_the_tokens_so_far(server):
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        metas = [json.loads(line[6:])["meta_info"] for line in r.iter_lines(decode_unicode=True)
                 if line.startswith("data: {")]
    assert metas and metas[-1]["output_token_logprobs_length"] == 6
    for m in metas:
        assert m["output_token_logprobs_length"] == m["completion_tokens"] == len(m["output_token_logprobs"])


def test_token_ids_logprob_returns_the_chosen_ids_at_every_position(server, tiny_llama_dir):
    """SGLang's classification-style scoring: meta_info.input_token_ids_logprobs
    (per prompt position from logprob_start_len, the first null) and
    output_token_ids_logprobs (per output token), [logprob, id, text] per id."""
    wanted = [17, 4, 250]
    r = requests.post(server.url + "/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 3, "token_ids_logprob": wanted,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    with torch.inference_mode():
        logits = load_hf(tiny_llama_dir)(torch.tensor([PROMPT + out["output_ids"]])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == len(PROMPT) - 3 and inputs[0] is None
    for p, entries in zip(range(3, len(PROMPT) - 1), inputs[1:]):
        assert [e[1] for e in entries] == wanted and all(isinstance(e[2], str) for e in entries)
        assert [e[0] for e in entries] == pytest.approx(lps[p, wanted].tolist(), abs=1e-4)
    outputs = meta["output_token_ids_logprobs"]
    assert len(outputs) == 3
    for k, entries in enumerate(outputs):
        assert [e[0] for e in entries] == pytest.approx(lps[len(PROMPT) - 1 + k, wanted].tolist(), abs=1e-4)
    r = requests.post(server.url + "/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [1, [2]]}, timeout=30)
    assert r.status_code == 400 and "token_ids_logprob[1]" in r.text
