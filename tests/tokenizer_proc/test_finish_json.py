"""The one place finish reasons become what a client sees: their JSON, and an
abort's HTTP status (tokenizer_proc/finish_json.py)."""

from __future__ import annotations

import msgspec
import pytest

from common.messages import (AbortKind, BatchTokenOut, FinishAbort, FinishLength, FinishMatchedStr,
                             FinishMatchedToken, ToTokenizerMsg)
from tokenizer_proc.errors import BadRequestError, ServiceUnavailableError
from tokenizer_proc.finish_json import ABORT_STATUS, abort_error, finish_json, matched, refusal_error


def test_finish_reasons_show_as_the_http_api_documents_them() -> None:
    assert finish_json(None) is None
    assert finish_json(FinishMatchedToken(7)) == {"type": "stop", "matched": 7}
    assert finish_json(FinishMatchedStr(" the end")) == {"type": "stop", "matched": " the end"}
    assert finish_json(FinishLength(12)) == {"type": "length", "length": 12}
    assert msgspec.json.encode(finish_json(FinishAbort(AbortKind.DEADLINE, "deadline exceeded"))) == \
        b'{"type":"abort","message":"deadline exceeded"}'


@pytest.mark.parametrize("kind,status", [(AbortKind.QUEUE_FULL, 503), (AbortKind.INVALID, 400),
                                         (AbortKind.SERVER_DOWN, 503)])
def test_a_refusal_names_its_status_and_is_answered_with_it(kind: AbortKind, status: int) -> None:
    reason = FinishAbort(kind, "why")
    assert msgspec.json.encode(finish_json(reason)) == \
        b'{"type":"abort","message":"why","status_code":%d}' % status
    error = refusal_error(reason)
    assert error is not None and error.status == status and error.message == "why"


@pytest.mark.parametrize("kind", [AbortKind.CLIENT_GONE, AbortKind.DEADLINE, AbortKind.SHUTDOWN,
                                  AbortKind.SERVER_ERROR])
def test_other_aborts_are_not_refusals(kind: AbortKind) -> None:
    reason = FinishAbort(kind, "why")
    assert finish_json(reason) == {"type": "abort", "message": "why"}
    assert refusal_error(reason) is None


def test_an_abort_as_the_whole_answer_is_503_when_the_client_may_retry_else_400() -> None:
    assert set(ABORT_STATUS) == set(AbortKind)
    for kind in (AbortKind.QUEUE_FULL, AbortKind.SERVER_DOWN, AbortKind.SHUTDOWN):
        error = abort_error(FinishAbort(kind, "the server is shutting down"))
        assert isinstance(error, ServiceUnavailableError) and error.message == "the server is shutting down"
    for kind in (AbortKind.INVALID, AbortKind.DEADLINE, AbortKind.CLIENT_GONE, AbortKind.SERVER_ERROR):
        error = abort_error(FinishAbort(kind, "deadline exceeded"))
        assert isinstance(error, BadRequestError)
        assert error.message == "the request was aborted: deadline exceeded"
    assert refusal_error(FinishLength(3)) is None and refusal_error(None) is None


def test_matched_names_the_stop_token_or_string() -> None:
    assert matched(FinishMatchedToken(2)) == 2 and matched(FinishMatchedStr("x")) == "x"
    assert matched(FinishLength(2)) is None and matched(FinishAbort(AbortKind.DEADLINE, "")) is None


def test_typed_finish_reasons_cross_the_socket_typed() -> None:
    out = BatchTokenOut(rids=["a", "b", "c"], new_token_ids=[[1], [], [2]], prompt_tokens=[1] * 3,
                        finished_reasons=[None, FinishAbort(AbortKind.INVALID, "bad"), FinishMatchedToken(2)],
                        completion_tokens=[1, 0, 1], cached_tokens=[0] * 3, num_retractions=[0] * 3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ToTokenizerMsg)
    assert back == out and back.finished_reasons[1].kind is AbortKind.INVALID
