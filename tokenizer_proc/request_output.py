"""What the client sees of one scheduler request.

The scheduler sends raw token ids (into a `ReqState`); a `RequestOutput` turns
them into text incrementally, cuts the text at a stop string, and keeps the
output ids and logprobs aligned with what it shows. It is driven by the HTTP
handler (`update()` after each wake-up), so a failure here fails that one
request and nothing else.

When a stop string (or stop regex) matches, the output is finished here,
before the scheduler knows; the caller then tells the scheduler (a
StopMatchedReq, which frees its KV) and the scheduler's later final row is
never read. With
`no_stop_trim` the matched stop string, or the text of a matched stop token,
stays in the text (SGLang's).

An update is two halves: `take()` copies what arrived, on the event loop (the
scheduler's rows are appended there), and `apply()` detokenizes and matches
it, touching only this object, so that a caller may run it on a worker
thread. Stop matching has a CPU budget per request (MATCH_BUDGET_S plus
MATCH_BUDGET_PER_TOKEN_S a token): a request past it ends as an abort saying so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from common.messages import AbortKind, FinishAbort, FinishMatchedStr, FinishMatchedToken, FinishReason
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.finish_json import finish_json
from tokenizer_proc.manager import ReqState
from tokenizer_proc.request_spec import RequestSpec
from tokenizer_proc.stop_strings import StopStringMatcher
from tokenizer_proc.tokenizer import Tokenizer


# Stop matching's CPU budget per request: the base, and as much again per token
# fed (a long output with many stop regexes needs far less: tens of microseconds a token).
MATCH_BUDGET_S = 1.0
MATCH_BUDGET_PER_TOKEN_S = 0.002


def matched_stop_token(reason: FinishReason | None, ids: list[int]) -> bool:
    """The scheduler stopped on a stop token (EOS or stop_token_ids) that ends
    `ids`: that token is an output id but not part of the text."""
    return isinstance(reason, FinishMatchedToken) and bool(ids) and ids[-1] == reason.token


@dataclass(slots=True)
class Arrival:
    """What the scheduler sent for one request since the last `take()`."""

    ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]
    token_ids_logprobs: list[list[float]]  # with token_ids_logprob
    reason: FinishReason | None  # set on the final row
    trim: bool  # the last id is a matched stop token: not part of the text


class RequestOutput:
    def __init__(self, state: ReqState, spec: RequestSpec, tokenizer: Tokenizer) -> None:
        self.state = state
        self.spec = spec
        self.detok = IncrementalDetokenizer(tokenizer, spec.req.sampling_params.skip_special_tokens)
        self.matcher = StopStringMatcher(spec.stop, spec.stop_regex, keep=spec.no_stop_trim) \
            if spec.matches_text else None
        self.fed = 0  # state.output_ids taken so far
        self.match_cpu_s = 0.0  # CPU seconds spent in stop matching (its budget's measure)
        self.encoded_input_logprobs: dict[str, Any] | None = None  # kept by native_api once built
        self.ids: list[int] = []  # output ids shown (cut after the token that completed a stop string)
        # text shown (detokenized, stop string and anything after it removed), in
        # the pieces it came in: appending to one string would copy it all per token
        self._parts: list[str] = []
        self.text_len = 0
        self.token_logprobs: list[float] = []  # aligned with ids when asked for
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.token_ids_logprobs: list[list[float]] = []  # aligned with ids, with token_ids_logprob
        self.finish_reason: FinishReason | None = None
        self.stopped_here = False  # finished here (a stop string), before the scheduler knew

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def text_since(self, offset: int) -> str:
        """text[offset:], at the cost of the pieces after `offset` only."""
        tail, pos = [], self.text_len
        for part in reversed(self._parts):
            if pos <= offset:
                break
            pos -= len(part)
            tail.append(part)
        return "".join(reversed(tail))[offset - pos:]

    def _append(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self.text_len += len(delta)

    @property
    def rid(self) -> str:
        return self.state.rid

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def text_ids_len(self) -> int:
        """How many of `ids` are text: all but a matched stop token (unless no_stop_trim)."""
        if not self.spec.no_stop_trim and matched_stop_token(self.finish_reason, self.ids):
            return len(self.ids) - 1
        return len(self.ids)

    def update(self) -> bool:
        """Consumes what the scheduler sent since the last call; True if
        anything changed (new ids, new text, or the end)."""
        arrival = self.take()
        return arrival is not None and self.apply(arrival)

    def take(self) -> Arrival | None:
        """What arrived since the last take (None: nothing). On the event loop,
        where the scheduler's rows are appended, so ids, logprobs and the end
        are read as one."""
        st = self.state
        if self.done:
            return None
        reason = st.finish_reason
        end = len(st.output_ids)
        if end == self.fed and reason is None:
            return None
        start, self.fed = self.fed, end
        logprobs = self.spec.req.return_logprob
        return Arrival(
            ids=st.output_ids[start:end],
            token_logprobs=st.token_logprobs[start:end] if logprobs else [],
            top_logprobs=st.top_logprobs[start:end] if logprobs else [],
            token_ids_logprobs=st.token_ids_logprobs[start:end] if logprobs else [],
            reason=reason,
            trim=reason is not None and not self.spec.no_stop_trim and matched_stop_token(reason, st.output_ids))

    def apply(self, arrival: Arrival) -> bool:
        """Detokenizes and matches what `take()` returned; touches only this
        output (a worker thread may run it). True if anything changed."""
        if self.done:
            return False
        new = arrival.ids
        text_new = new[:-1] if arrival.trim else new
        # With stop strings, one token at a time: the match must name the token
        # that completed it, so output ids and logprobs end there too.
        step = 1 if self.matcher else max(len(new), 1)
        for k in range(0, len(new), step):
            self._take_ids(arrival, k, min(k + step, len(new)))
            if self._show(self.detok.add(text_new[k:k + step])):
                return True
        if arrival.reason is not None:
            if self._show(self.detok.flush()):
                return True
            if self.matcher:
                self._append(self.matcher.flush())
            self.finish_reason = arrival.reason
        return True

    def _take_ids(self, arrival: Arrival, start: int, stop: int) -> None:
        self.ids.extend(arrival.ids[start:stop])
        if self.spec.req.return_logprob:
            self.token_logprobs.extend(arrival.token_logprobs[start:stop])
            self.top_logprobs.extend(arrival.top_logprobs[start:stop])
            self.token_ids_logprobs.extend(arrival.token_ids_logprobs[start:stop])

    def _show(self, delta: str) -> bool:
        """Appends text (through the stop matcher); True when a stop string
        matched, or when matching ran out of its budget."""
        if self.matcher is None:
            self._append(delta)
            return False
        started = time.thread_time()  # CPU time: a loaded machine does not eat the budget
        self._append(self.matcher.feed(delta))
        self.match_cpu_s += time.thread_time() - started
        if self.matcher.matched is not None:
            self.finish_reason = FinishMatchedStr(self.matcher.matched)
            self.stopped_here = True
            return True
        budget = MATCH_BUDGET_S + MATCH_BUDGET_PER_TOKEN_S * len(self.ids)
        if self.match_cpu_s > budget:
            self.finish_reason = FinishAbort(
                AbortKind.SERVER_ERROR,
                f"stop matching used more than its CPU budget ({budget:.2f} s: {MATCH_BUDGET_S:g} s and "
                f"{MATCH_BUDGET_PER_TOKEN_S * 1000:g} ms a token); the request was ended")
            self.stopped_here = True
            return True
        return False

    def meta_info(self) -> dict[str, Any]:
        st = self.state
        info = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": st.cached_tokens,
            "num_retractions": st.num_retractions,
            "queue_time": st.queue_time,
            "finish_reason": finish_json(self.finish_reason),
            "e2e_latency": time.perf_counter() - st.arrival,
        }
        if st.spec is not None:  # SGLang's names: verify steps, and tokens per verify when it drafted
            verify_ct, accepted = st.spec
            info["spec_verify_ct"] = verify_ct
            info["spec_accept_length"] = (verify_ct + accepted) / verify_ct if verify_ct else 0.0
        return info
