"""Speculative decoding as a user meets it (--speculative-algorithm NGRAM, the
default model, real processes and HTTP): answers equal the server's without
it, greedy and seeded, for requests that draft well; a stop string landing
inside a run of accepted tokens cuts the stream there; streams carry several
tokens per event and still add up to the whole answer; meta_info, /metrics
and /get_server_info report the drafts."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.e2e.server_process import ServerProcess

# prompts the default model answers by copying from them: prompt lookup drafts well
COPYING = ["Repeat this sentence exactly, three times: The quick brown fox jumps over the lazy dog.",
           "Rewrite this code with the variable x renamed to y:\n\ndef add(x, z):\n    total = x + z\n"
           "    return total * x\n"]


@pytest.fixture(scope="module")
def spec_server():
    """Every draft verified (--disable-speculative-adaptive), and drafts only
    from the request's own tokens (no table of recent outputs): which steps
    verify what depends on the request alone, not on the step times this
    machine measures nor on the requests before it (the adaptive policy and
    the table: tests/scheduler/test_speculative.py, and the benchmark)."""
    srv = ServerProcess("--max-running-requests", "4", "--enable-metrics", "--speculative-algorithm", "NGRAM",
                        "--disable-speculative-adaptive", "--speculative-ngram-capacity", "0")
    yield srv
    srv.kill()


def generate(srv: ServerProcess, body: dict) -> dict:
    r = requests.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}],
                         ids=["greedy", "seeded"])
def test_answers_equal_the_server_without_speculation(spec_server, shared_server, sampling):
    """shared_server: the same flags but the speculation (tests/conftest.py)."""
    lengths = []
    # greedy: both prompts; seeded: one (its draws are checked token for token all the same)
    for prompt in COPYING if sampling["temperature"] == 0 else COPYING[1:]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 48, **sampling}}
        ours, ref = generate(spec_server, body), generate(shared_server, body)
        assert ours["output_ids"] == ref["output_ids"]
        assert ours["text"] == ref["text"]
        lengths.append(ours["meta_info"]["spec_accept_length"])
        assert ours["meta_info"]["spec_verify_ct"] > 0
    if sampling["temperature"] == 0:
        assert max(lengths) > 2.0, lengths  # several tokens a step where the answer copies the prompt


def test_a_stop_string_inside_an_accepted_run_cuts_the_stream_there(spec_server, shared_server):
    # the answer quotes the sentence: "fox jumps" comes inside a copied run
    body = {"text": COPYING[0], "sampling_params": {"max_new_tokens": 60, "temperature": 0, "stop": ["fox jumps"]},
            "stream": True}
    chunks, metas = [], []
    with requests.post(spec_server.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        seen = ""
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            chunks.append(event["text"][len(seen):])
            seen = event["text"]
            metas.append(event["meta_info"])
    ref = generate(shared_server, {**body, "stream": False})
    assert seen == ref["text"] and "fox jumps" not in seen
    assert metas[-1]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert metas[-1]["finish_reason"]["type"] == "stop"
    assert metas[-1]["spec_verify_ct"] > 0
    # the stop came inside one event of several accepted tokens
    assert metas[-1]["completion_tokens"] - metas[-2]["completion_tokens"] > 1


def test_an_openai_stream_adds_up_to_the_whole_answer(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": COPYING[1]}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=50, temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=50, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == whole.choices[0].message.content
    # accepted drafts arrive together: fewer content events than tokens
    assert sum(1 for p in parts if p) < whole.usage.completion_tokens


def test_metrics_and_server_info_report_the_drafts(spec_server):
    generate(spec_server, {"text": COPYING[0], "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    state = requests.get(spec_server.url + "/get_server_info", timeout=30).json()["scheduler"]
    assert state["speculative_algorithm"] == "NGRAM"
    assert state["spec_verify_steps"] > 0 and 0 < state["spec_accepted_tokens"] <= state["spec_draft_tokens"]
    assert state["avg_spec_accept_length"] > 1.0
    for kind in ("decode", "verify"):
        fixed_ms, per_token_ms = state["spec_step_cost_ms"][kind]
        assert fixed_ms > 0 and per_token_ms > 0
    metrics = requests.get(spec_server.url + "/metrics", timeout=30).text
    accepted = [line for line in metrics.splitlines() if line.startswith("batchserve_spec_accepted_tokens_total ")]
    assert accepted and float(accepted[0].split()[1]) == state["spec_accepted_tokens"]
