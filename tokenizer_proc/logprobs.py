"""Logprob layouts: SGLang's native one and OpenAI's two (chat, completions).

The scheduler sends, per output token, its logprob and (when asked) the top-n
(logprob, token id) pairs; this module only turns them into JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.request_output import RequestOutput
from tokenizer_proc.request_spec import RequestSpec
from tokenizer_proc.tokenizer import Tokenizer

# An answer with more logprob entries than this is built and encoded on a
# worker thread, in chunks (each a short hold of the GIL), not on the event loop.
LARGE_ANSWER_ENTRIES = 10_000
ENCODE_CHUNK = 1024  # list items encoded per msgspec call


def logprob_entries(spec: RequestSpec) -> int:
    """The most logprob entries one request can answer with: per prompt
    position from logprob_start_len and per new token, its own logprob and its
    top-n."""
    req = spec.req
    if not req.return_logprob:
        return 0
    positions = len(req.input_ids) - req.logprob_start_len if req.logprob_start_len >= 0 else 0
    return (positions + req.sampling_params.max_new_tokens) * (1 + req.top_logprobs_num)


def check_logprob_volume(specs: list[RequestSpec], bound: int) -> None:
    """Refuses a request whose logprobs could outgrow `bound` entries (over all
    its outputs), before it runs: prompt logprobs with a large top-n on a long
    prompt, times n, become an answer of gigabytes."""
    total = sum(logprob_entries(s) for s in specs)
    if total > bound:
        raise BadRequestError(
            f"the request asks for up to {total} logprob entries ((prompt positions from logprob_start_len + "
            f"max new tokens) x (1 + top logprobs), over {len(specs)} output(s)), more than this server's "
            f"bound of {bound} (--max-logprob-entries): ask for fewer top logprobs, a later "
            "logprob_start_len, fewer tokens or fewer samples")


def too_large_for_the_loop(entries: int) -> bool:
    """Logprob entries enough to build and encode off the event loop."""
    return entries > LARGE_ANSWER_ENTRIES


def large_answer(outputs: list[RequestOutput]) -> bool:
    entries = 0
    for out in outputs:
        if out.spec.req.return_logprob:
            positions = len(out.ids) + len(out.state.input_token_logprobs)
            entries += positions * (1 + out.spec.req.top_logprobs_num)
    return too_large_for_the_loop(entries)


def encoded_list(items: Iterable[Any]) -> msgspec.Raw:
    """A JSON list, encoded ENCODE_CHUNK items at a time: on a worker thread the
    GIL is let go between chunks, where one msgspec call on a huge list would hold it."""
    parts, batch = [], []
    for item in items:
        batch.append(item)
        if len(batch) == ENCODE_CHUNK:
            parts.append(msgspec.json.encode(batch)[1:-1])
            batch = []
    if batch:
        parts.append(msgspec.json.encode(batch)[1:-1])
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


class TokenTexts:
    """Text of single tokens, cached: the same tokens recur in every top-n list."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            # Special tokens shown as themselves: a logprob entry names a token.
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 100_000:
                self._cache[token_id] = text
        return text


# ---- SGLang native: meta_info.output_token_logprobs / output_top_logprobs ------------------


def native_token_logprobs(ids: list[int], lps: list[float | None], texts: TokenTexts | None,
                          chunked: bool = False) -> list[list[Any]] | msgspec.Raw:
    """[[logprob, token_id, text_or_null], ...] (a prompt's first logprob is null);
    `chunked`: already encoded (`encoded_list`)."""
    rows = ([lp, i, texts(i) if texts else None] for lp, i in zip(lps, ids))
    return encoded_list(rows) if chunked else list(rows)


def native_top_logprobs(tops: list[list[tuple[float, int]] | None], texts: TokenTexts | None,
                        chunked: bool = False) -> list[list[list[Any]] | None] | msgspec.Raw:
    """Per position: [[logprob, token_id, text_or_null], ...], or null (a prompt's first)"""
    rows = (None if pos is None else [[lp, i, texts(i) if texts else None] for lp, i in pos] for pos in tops)
    return encoded_list(rows) if chunked else list(rows)


def native_ids_logprobs(ids: list[int], per_position: list[list[float] | None],
                        texts: TokenTexts | None) -> list[list[list[Any]] | None]:
    """token_ids_logprob: per position [[logprob, token_id, text_or_null], ...]
    for the requested ids in their order, or null (a prompt's first)"""
    return [None if vals is None else [[lp, i, texts(i) if texts else None] for lp, i in zip(vals, ids)]
            for vals in per_position]


# ---- OpenAI chat: {"content": [{token, logprob, bytes, top_logprobs}]} ---------------------


def _chat_entry(token_id: int, lp: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(ids: list[int], lps: list[float], tops: list[list[tuple[float, int]]],
                  texts: TokenTexts, top_n: int) -> dict[str, Any]:
    content = []
    for k, (token_id, lp) in enumerate(zip(ids, lps)):
        entry = _chat_entry(token_id, lp, texts)
        pairs = tops[k][:top_n] if k < len(tops) else []
        entry["top_logprobs"] = [_chat_entry(i, v, texts) for v, i in pairs]
        content.append(entry)
    return {"content": content}


# ---- OpenAI completions: {tokens, token_logprobs, top_logprobs, text_offset} ---------------


def completion_logprobs(ids: list[int], lps: list[float | None], tops: list[list[tuple[float, int]] | None],
                        texts: TokenTexts, top_n: int, offset: int) -> dict[str, Any]:
    """`offset`: length of the text before these tokens (for text_offset). An
    echoed prompt's first token has null logprob and top_logprobs."""
    tokens, offsets, top = [], [], []
    for k, token_id in enumerate(ids):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        pairs = tops[k] if k < len(tops) else []
        top.append(None if pairs is None else {texts(i): v for v, i in pairs[:top_n]})
    return {"tokens": tokens, "token_logprobs": list(lps[:len(ids)]), "top_logprobs": top,
            "text_offset": offsets}
