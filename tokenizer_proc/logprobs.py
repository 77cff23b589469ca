"""Logprob layouts: SGLang's native one and OpenAI's two (chat, completions).

The scheduler sends, per output token, its logprob and (when asked) the top-n
(logprob, token id) pairs; this module only turns them into JSON.
"""

from __future__ import annotations

from typing import Any

from tokenizer_proc.tokenizer import Tokenizer


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


def native_token_logprobs(ids: list[int], lps: list[float | None], texts: TokenTexts | None) -> list[list[Any]]:
    """[[logprob, token_id, text_or_null], ...] (a prompt's first logprob is null)"""
    return [[lp, i, texts(i) if texts else None] for lp, i in zip(lps, ids)]


def native_top_logprobs(tops: list[list[tuple[float, int]] | None],
                        texts: TokenTexts | None) -> list[list[list[Any]] | None]:
    """Per position: [[logprob, token_id, text_or_null], ...], or null (a prompt's first)"""
    return [None if pos is None else [[lp, i, texts(i) if texts else None] for lp, i in pos] for pos in tops]


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
