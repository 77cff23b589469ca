"""SGLang's token_ids_logprob on /generate: a flat list of token ids (or,
with a list of prompts, one list per prompt) reaches the scheduler with the
request; anything else is a 400 naming the field and the position."""

from __future__ import annotations

from typing import Any

import pytest

from common.sampling_rules import MAX_TOKEN_IDS_LOGPROB
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.protocol import check_generate_request

VOCAB = 1000


def _reqs(body: dict[str, Any]) -> list[Any]:
    pending = check_generate_request({"return_logprob": True, **body}, context_len=512, vocab_size=VOCAB)
    return [s.req for s in pending.finish([[5, 6, 7]] * len(pending.prompts)).specs]


def test_a_flat_list_goes_to_every_request_of_the_body() -> None:
    reqs = _reqs({"text": ["a", "b"], "token_ids_logprob": [3, 9, 3], "sampling_params": {"n": 2}})
    assert [r.token_ids_logprob for r in reqs] == [[3, 9, 3]] * 4


def test_a_list_of_lists_is_one_per_prompt() -> None:
    reqs = _reqs({"input_ids": [[5, 6], [7, 8]], "token_ids_logprob": [[1, 2], None]})
    assert [r.token_ids_logprob for r in reqs] == [[1, 2], []]


def test_without_return_logprob_nothing_is_asked_for() -> None:
    reqs = _reqs({"text": "a", "token_ids_logprob": [1], "return_logprob": False})
    assert reqs[0].token_ids_logprob == []


@pytest.mark.parametrize("body,message", [
    ({"text": "a", "token_ids_logprob": 5}, "token_ids_logprob must be a list of token ids"),
    ({"text": "a", "token_ids_logprob": "5"}, "token_ids_logprob must be a list of token ids"),
    ({"text": "a", "token_ids_logprob": [1, "2"]}, "token_ids_logprob[1] must be an integer token id, not str"),
    ({"text": "a", "token_ids_logprob": [1, True]}, "token_ids_logprob[1] must be an integer token id, not bool"),
    ({"text": "a", "token_ids_logprob": [1.0]}, "token_ids_logprob[0] must be an integer token id, not float"),
    ({"text": "a", "token_ids_logprob": [1, [2]]}, "token_ids_logprob[1] must be an integer token id, not list"),
    ({"text": "a", "token_ids_logprob": [[1, 2]]}, "token_ids_logprob must be a flat list of token ids"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1], [[2]]]},
     "token_ids_logprob[1][0] must be an integer token id, not list"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1]]}, "one list per prompt (2)"),
    ({"text": "a", "token_ids_logprob": [3, VOCAB]}, f"token id {VOCAB} is out of the vocabulary [0, {VOCAB})"),
    ({"text": "a", "token_ids_logprob": [-1]}, "token id -1 is out of the vocabulary"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1], [VOCAB + 5]]}, "token_ids_logprob[1]: token id"),
    ({"text": "a", "token_ids_logprob": list(range(MAX_TOKEN_IDS_LOGPROB + 1))},
     f"at most {MAX_TOKEN_IDS_LOGPROB} token ids"),
], ids=["int", "string", "string-id", "bool-id", "float-id", "nested-in-flat", "lists-for-one-prompt",
        "too-deep", "wrong-count", "past-vocab", "negative", "past-vocab-per-prompt", "too-many"])
def test_a_malformed_token_ids_logprob_is_a_400_naming_it(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequestError) as e:
        _reqs(body)
    assert message in str(e.value)
