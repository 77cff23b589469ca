"""One rule set for the sampling parameters' ranges (common/sampling_rules.py):
the tokenizer process and the scheduler refuse the same values, with the same words."""

from __future__ import annotations

import pytest

from common.messages import AbortKind, FinishAbort, Grammar, GrammarKind, SamplingParams, TokenizedGenerateReq
from common.sampling_rules import MAX_SEED, MAX_TOKEN_ID, MAX_TOP_K, sampling_error
from tests.scheduler.test_scheduler import Harness
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.protocol import MAX_N, validate_sampling_params

BAD = [
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be -1 or 0 (both: off)"),
    ({"top_k": MAX_TOP_K + 1}, "top_k must be -1 or 0 (both: off)"),
    ({"seed": -1}, "seed must be in [0, "),
    ({"seed": MAX_SEED + 1}, "seed must be in [0, "),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"stop_token_ids": [MAX_TOKEN_ID + 1]}, "stop_token_ids must be in [0, "),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be in [0, "),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -3.0}, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
    ({"min_new_tokens": 9}, "min_new_tokens must be in [0, max_new_tokens] (here [0, 5])"),
    ({"min_new_tokens": 1, "grammar": Grammar(GrammarKind.REGEX, "[a-z]+")},
     "min_new_tokens cannot be combined with a grammar"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias: biases must be in"),
    ({"logit_bias": {3: 1e300}}, "logit_bias: biases must be in"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias: token ids must be in [0, 1000)"),
    ({"stream_interval": 0}, "stream_interval must be in [1, "),
]


def params(fields: dict) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 5, **fields})


@pytest.mark.parametrize("fields,message", BAD)
def test_each_rule_names_the_field_it_refuses(fields: dict, message: str) -> None:
    error = sampling_error(params(fields), vocab_size=1000)
    assert error is not None and error.startswith(message), error


def test_the_defaults_and_the_edges_of_each_range_pass() -> None:
    assert sampling_error(SamplingParams(), vocab_size=1000) is None
    edges = params({"temperature": 0.0, "top_p": 1.0, "top_k": MAX_TOP_K, "seed": MAX_SEED, "min_p": 1.0,
                    "stop_token_ids": [0, MAX_TOKEN_ID], "frequency_penalty": -2.0, "presence_penalty": 2.0,
                    "repetition_penalty": 2.0, "min_new_tokens": 5, "logit_bias": {999: -1e9},
                    "stream_interval": MAX_TOKEN_ID})
    assert sampling_error(edges, vocab_size=1000) is None
    assert sampling_error(params({"top_k": 0}), vocab_size=1000) is None  # 0 is off, as -1


@pytest.mark.parametrize("fields,message", BAD)
def test_the_tokenizer_and_the_scheduler_refuse_the_same_values(fields: dict, message: str) -> None:
    with pytest.raises(BadRequestError, match="^sampling_params." + message[:12].replace("(", r"\(")):
        validate_sampling_params(params(fields), "sampling_params.", vocab_size=1000)
    h = Harness()  # its fake model has 1000 tokens
    h.sched.process_input_requests([TokenizedGenerateReq(rid="bad", input_ids=[5, 6], sampling_params=params(fields))])
    reason = h.outputs[-1].finished_reasons[0]
    assert isinstance(reason, FinishAbort) and reason.kind is AbortKind.INVALID
    assert reason.message.startswith(message), reason.message


def test_a_seed_shared_by_n_samples_leaves_room_for_each_one() -> None:
    base = MAX_SEED - MAX_N
    validate_sampling_params(params({"seed": base}))
    with pytest.raises(BadRequestError, match=rf"seed must be in \[0, {base}\]"):
        validate_sampling_params(params({"seed": base + 1}))
    assert sampling_error(params({"seed": base + MAX_N - 1})) is None  # the last sample's seed
