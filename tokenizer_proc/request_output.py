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
"""

from __future__ import annotations

import time
from typing import Any

from common.messages import AbortKind, FinishAbort, FinishMatchedStr, FinishMatchedToken, FinishReason
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.finish_json import finish_json
from tokenizer_proc.manager import ReqState
from tokenizer_proc.request_spec import RequestSpec
from tokenizer_proc.stop_strings import StopRegexTimeout, StopStringMatcher
from tokenizer_proc.tokenizer import Tokenizer


def matched_stop_token(reason: FinishReason | None, ids: list[int]) -> bool:
    """The scheduler stopped on a stop token (EOS or stop_token_ids) that ends
    `ids`: that token is an output id but not part of the text."""
    return isinstance(reason, FinishMatchedToken) and bool(ids) and ids[-1] == reason.token


class RequestOutput:
    def __init__(self, state: ReqState, spec: RequestSpec, tokenizer: Tokenizer) -> None:
        self.state = state
        self.spec = spec
        self.detok = IncrementalDetokenizer(tokenizer, spec.req.sampling_params.skip_special_tokens)
        self.matcher = StopStringMatcher(spec.stop, spec.stop_regex, keep=spec.no_stop_trim) \
            if spec.matches_text else None
        self.fed = 0  # state.output_ids consumed so far
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
        if self.done:
            return False
        st = self.state
        end, final = len(st.output_ids), st.finished
        if end == self.fed and not final:
            return False
        new = st.output_ids[self.fed:end]
        trim = final and not self.spec.no_stop_trim and matched_stop_token(st.finish_reason, st.output_ids)
        text_new = new[:-1] if trim else new
        # With stop strings, one token at a time: the match must name the token
        # that completed it, so output ids and logprobs end there too.
        step = 1 if self.matcher else max(len(new), 1)
        for k in range(0, len(new), step):
            self._take_ids(self.fed + k, min(self.fed + k + step, end))
            if self._show(self.detok.add(text_new[k:k + step])):
                return True
        self.fed = end
        if final:
            if self._show(self.detok.flush()):
                return True
            if self.matcher:
                self._append(self.matcher.flush())
            self.finish_reason = st.finish_reason
        return True

    def _take_ids(self, start: int, stop: int) -> None:
        st = self.state
        self.ids.extend(st.output_ids[start:stop])
        if self.spec.req.return_logprob:
            self.token_logprobs.extend(st.token_logprobs[start:stop])
            self.top_logprobs.extend(st.top_logprobs[start:stop])
            self.token_ids_logprobs.extend(st.token_ids_logprobs[start:stop])

    def _show(self, delta: str) -> bool:
        """Appends text (through the stop matcher); True when a stop string matched."""
        if self.matcher is None:
            self._append(delta)
            return False
        try:
            self._append(self.matcher.feed(delta))
        except StopRegexTimeout as e:  # this request ends, with the reason
            self.finish_reason = FinishAbort(AbortKind.SERVER_ERROR, str(e))
            self.stopped_here = True
            return True
        if self.matcher.matched is None:
            return False
        self.finish_reason = FinishMatchedStr(self.matcher.matched)
        self.stopped_here = True
        return True

    def meta_info(self) -> dict[str, Any]:
        st = self.state
        return {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": st.cached_tokens,
            "num_retractions": st.num_retractions,
            "queue_time": st.queue_time,
            "finish_reason": finish_json(self.finish_reason),
            "e2e_latency": time.perf_counter() - st.arrival,
        }
