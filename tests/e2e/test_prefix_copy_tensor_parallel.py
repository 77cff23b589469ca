"""A prefix match that ends inside a KV page, under tensor parallelism: every
rank copies the rows of its own heads (each gets the same batch), so a
repeated prompt reports cached_tokens = prompt - 1 and answers as its first,
uncached, run (--tp-size 2, gloo on the CPU, a tiny random model)."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.server_process import ServerProcess
from tests.helpers import greedy_parting, make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tp_copy_tiny")))


def test_tp2_a_repeated_prompt_reuses_all_but_its_last_token_and_answers_alike(tiny_model, default_model_dir):
    srv = ServerProcess("--model-path", tiny_model, "--tokenizer-path", default_model_dir, "--tp-size", "2",
                        "--dtype", "float32", "--page-size", "16", "--max-running-requests", "4")
    try:
        for n in (6, 35):
            ids = [(i * 37 + 11 * n) % 500 + 3 for i in range(n)]
            body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
            first, again = (requests.post(srv.url + "/generate", json=body, timeout=120).json() for _ in range(2))
            assert first["meta_info"]["cached_tokens"] == 0
            assert again["meta_info"]["cached_tokens"] == n - 1
            tops = [[[t for _, t, *_ in top] for top in r["meta_info"]["output_top_logprobs"]]
                    for r in (first, again)]
            assert greedy_parting(again["output_ids"], tops[1], first["output_ids"], tops[0]) is None
    finally:
        srv.kill()
