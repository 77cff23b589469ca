"""The prefix cache as a user meets it on a real server (default model): a
repeated prompt reuses all but its last token (pages of 16: the rows of a
page the match ends inside are copied), a second turn reuses the first,
salts isolate tenants, /flush_cache empties the cache, the OpenAI routes
report cached tokens, /metrics and /get_server_info show the cache, and
--disable-radix-cache turns it off."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.e2e.server_process import ServerProcess
from tests.helpers import greedy_parting

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer briefly and precisely, in plain "
          "words, and never make anything up.<|im_end|>\n")


def ask(text: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    # the session's shared server (tests/conftest.py): the default dtype, metrics on; each
    # test flushes the cache where what it finds there matters
    return shared_server


def generate(srv: ServerProcess, body: dict) -> dict:
    r = requests.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def flush(srv: ServerProcess) -> None:
    r = requests.post(srv.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text


def prompt_ids(srv: ServerProcess, text: str) -> list[int]:
    """The prompt's token ids, from the served model's own tokenizer."""
    from transformers import AutoTokenizer

    info = requests.get(srv.url + "/get_model_info", timeout=30).json()
    return AutoTokenizer.from_pretrained(info["tokenizer_path"])(text, add_special_tokens=False)["input_ids"]


def test_a_second_turn_takes_the_first_turns_prompt_and_answer_from_the_cache(server):
    flush(server)
    turn1 = prompt_ids(server, ask("Name three colours."))
    first = generate(server, {"input_ids": turn1,
                              "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert first["meta_info"]["cached_tokens"] == 0
    answer = first["output_ids"]
    turn2 = turn1 + answer + prompt_ids(server, "<|im_end|>\n<|im_start|>user\nAnd three more?<|im_end|>\n")
    second = generate(server, {"input_ids": turn2,
                               "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    # everything the first turn computed: its prompt and its answer (but the
    # answer's last token, whose KV was never computed), to the token
    assert second["meta_info"]["cached_tokens"] >= len(turn1) + len(answer) - 1


def test_a_repeated_prompt_reuses_all_but_its_last_token_and_answers_as_without_the_cache(server):
    """SGLang's expectation, with our pages of 16: a 6-token prompt (no whole
    page) and a 35-token chat turn (two pages and 2 rows) repeated report
    cached_tokens = prompt - 1, and the same greedy answer as the first,
    uncached, run (tests/helpers.greedy_parting)."""
    sched = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler"]
    assert sched["page_size"] == 16
    for ids in (prompt_ids(server, "The capital city of France is Paris")[:6], prompt_ids(server, ask("Why?"))[:35]):
        flush(server)
        body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        first, again = generate(server, body), generate(server, body)
        assert len(ids) in (6, 35) and first["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] == len(ids) - 1
        tops = [[[t for _, t, *_ in top] for top in r["meta_info"]["output_top_logprobs"]] for r in (first, again)]
        # identical, or parted at a near-tie (a token of each among the other's top 5:
        # the last prompt token is computed in a batch of another shape)
        greedy_parting(again["output_ids"], tops[1], first["output_ids"], tops[0])


def test_requests_with_different_cache_salts_do_not_share_the_cache(server):
    flush(server)
    body = {"text": ask("What is two plus two?"), "sampling_params": {"max_new_tokens": 2}}
    assert generate(server, {**body, "cache_salt": "tenant-a"})["meta_info"]["cached_tokens"] == 0
    assert generate(server, {**body, "cache_salt": "tenant-b"})["meta_info"]["cached_tokens"] == 0
    assert generate(server, body)["meta_info"]["cached_tokens"] == 0  # no salt: a tenant of its own
    again = generate(server, {**body, "cache_salt": "tenant-a"})["meta_info"]
    assert again["cached_tokens"] == again["prompt_tokens"] - 1
    bad = requests.post(server.url + "/generate", json={**body, "cache_salt": 7}, timeout=30)
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


def test_flush_cache_empties_the_cache(server):
    body = {"text": ask("Spell the word cat."), "sampling_params": {"max_new_tokens": 2}}
    generate(server, body)
    assert generate(server, body)["meta_info"]["cached_tokens"] > 0
    flush(server)
    sched = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler"]
    assert sched["evictable_kv_slots"] == 0 and sched["radix_tree_nodes"] == 0
    assert sched["free_kv_slots"] == sched["total_kv_slots"]
    assert generate(server, body)["meta_info"]["cached_tokens"] == 0


def test_openai_routes_report_cached_prompt_tokens_and_take_a_salt(server):
    flush(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "What colour is the sky?"}]
    first = client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                           temperature=0, extra_body={"cache_salt": "s1"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                            temperature=0, extra_body={"cache_salt": "s1"})
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    other = client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                           temperature=0, extra_body={"cache_salt": "s2"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    comp = client.completions.create(model="default", prompt="The sky is blue because", max_tokens=4)
    comp2 = client.completions.create(model="default", prompt="The sky is blue because", max_tokens=4)
    assert comp.usage.prompt_tokens_details.cached_tokens == 0
    assert comp2.usage.prompt_tokens_details.cached_tokens == comp2.usage.prompt_tokens - 1


def test_metrics_and_server_info_show_the_cache(server):
    body = {"text": ask("Say hello."), "sampling_params": {"max_new_tokens": 2}}
    generate(server, body)
    generate(server, body)
    sched = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler"]
    assert sched["radix_cache"] is True and sched["invariant_error"] is None
    assert sched["evictable_kv_slots"] > 0 and sched["radix_tree_nodes"] > 0
    assert sched["held_kv_slots"] == 0 and sched["protected_kv_slots"] == 0
    assert 0 < sched["cache_hit_rate"] <= 1
    text = requests.get(server.url + "/metrics", timeout=30).text
    assert "batchserve_cache_hit_rate " in text
    cached_total = next(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("batchserve_cached_tokens_total "))
    assert cached_total > 0


def test_disable_radix_cache_turns_the_cache_off():
    srv = ServerProcess("--max-running-requests", "2", "--disable-radix-cache")
    try:
        body = {"text": ask("Say hello."), "sampling_params": {"max_new_tokens": 2}}
        generate(srv, body)
        assert generate(srv, body)["meta_info"]["cached_tokens"] == 0
        sched = requests.get(srv.url + "/get_server_info", timeout=30).json()["scheduler"]
        assert sched["radix_cache"] is False and sched["evictable_kv_slots"] == 0
        assert sched["free_kv_slots"] == sched["total_kv_slots"]
    finally:
        srv.kill()
