"""SGLang's /v1/score: one single-token request per item, with the labels as
token_ids_logprob; the scores are their probabilities (the fake scheduler
gives label j the logprob -j/1000)."""

from __future__ import annotations

import json
import math

import pytest

from tests.tokenizer_proc.server_harness import Server, post
from tokenizer_proc.score_api import scores_from_logprobs

LABELS = [5, 100, 7]


def score(server: Server, body: dict) -> tuple[int, dict]:
    status, _, raw = post(server, body, "/v1/score")
    return status, json.loads(raw)


def test_each_item_is_scored_after_the_query(server: Server) -> None:
    before = len(server.fake.requests())
    status, r = score(server, {"query": "Is this fruit? ", "items": ["apple", "stone"], "label_token_ids": LABELS})
    assert status == 200 and r["object"] == "scoring" and r["model"] == "test"
    assert r["scores"] == [[pytest.approx(math.exp(-j / 1000)) for j in LABELS]] * 2
    reqs = server.fake.requests()[before:]
    assert [q.input_ids for q in reqs] == [server.tokenizer.encode("Is this fruit? apple"),
                                           server.tokenizer.encode("Is this fruit? stone")]
    assert all(q.sampling_params.max_new_tokens == 1 and q.token_ids_logprob == LABELS and q.return_logprob
               for q in reqs)
    assert r["usage"]["prompt_tokens"] == sum(len(q.input_ids) for q in reqs)


def test_token_ids_with_item_first_put_the_item_before_the_query(server: Server) -> None:
    status, r = score(server, {"query": [11, 12], "items": [[21], [22, 23]], "label_token_ids": LABELS,
                               "item_first": True, "apply_softmax": True})
    assert status == 200
    assert [q.input_ids for q in server.fake.requests()[-2:]] == [[21, 11, 12], [22, 23, 11, 12]]
    assert all(sum(row) == pytest.approx(1.0) for row in r["scores"])


def test_softmax_normalizes_over_the_labels() -> None:
    assert scores_from_logprobs([math.log(0.2), math.log(0.6)], True) == pytest.approx([0.25, 0.75])
    assert scores_from_logprobs([math.log(0.2), math.log(0.6)], False) == pytest.approx([0.2, 0.6])


@pytest.mark.parametrize("body,message", [
    ({"query": "q", "items": ["a"]}, "label_token_ids must be a non-empty list"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**9]}, "out of the vocabulary"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items must be a text or a non-empty list"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items must be a text or a non-empty list"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "list of token id lists"),
    ({"query": 3, "items": ["a"], "label_token_ids": [1]}, "query must be a text"),
])
def test_bad_score_requests_are_a_400(server: Server, body: dict, message: str) -> None:
    status, r = score(server, body)
    assert status == 400 and message in r["error"]["message"]
