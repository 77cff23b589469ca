"""Incremental detokenization for streaming.

Decoding token by token is wrong twice over: one character may span several
byte tokens (decoding half of it gives U+FFFD), and a token's text can depend
on its left neighbour (SentencePiece word-start spaces). So each step decodes
a short window twice, `ids[prefix_offset:read_offset]` (text already sent) and
`ids[prefix_offset:]`, and emits the difference; the window slides forward
only once the new text is complete.

The window stays short whatever the model outputs, so each token costs the
same at the end of a long output as at its start: tokens that add no text
(skipped special tokens) are dropped from it once more than a few pile up,
and bytes that have not made a character after MAX_HELD_TOKENS tokens (a
character is at most 4 bytes) are emitted as they decode, U+FFFD included.
"""

from __future__ import annotations

from tokenizer_proc.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8  # unread tokens kept waiting for their text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the tokens being read
        self.read_offset = 0  # tokens before this are already in `text`
        self.parts: list[str] = []  # everything emitted so far (joined on demand: `text`)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, new_ids: list[int]) -> str:
        """Feeds tokens; returns the text to append (may be "" while a
        multi-byte character is still incomplete)."""
        self.ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At the end of the stream: emits whatever was held back."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        decode = self.tokenizer.decode
        sent = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        held = len(self.ids) - self.read_offset
        if len(full) <= len(sent):  # nothing new (e.g. skipped special tokens)
            if held > MAX_HELD_TOKENS:
                del self.ids[self.read_offset:]  # they add no text: keep the window short
            return ""
        cut = len(self.ids)
        if full.endswith(REPLACEMENT_CHAR) and not final:
            if held <= MAX_HELD_TOKENS:
                return ""  # a character split across tokens: wait for the rest
            full, cut = self._clean_prefix(sent, full)
        delta = full[len(sent):]
        self.prefix_offset, self.read_offset = self.read_offset, cut
        self.parts.append(delta)
        return delta

    def _clean_prefix(self, sent: str, full: str) -> tuple[str, int]:
        """Many unread tokens whose text still ends mid-character: the text up
        to the last whole character (at most 4 tokens back: a character is at
        most 4 bytes) and where it ends; bytes that never make a character are
        emitted as they decode."""
        for end in range(len(self.ids) - 1, max(self.read_offset, len(self.ids) - 4) - 1, -1):
            text = self.tokenizer.decode(self.ids[self.prefix_offset:end], self.skip_special_tokens)
            if len(text) > len(sent) and not text.endswith(REPLACEMENT_CHAR):
                return text, end
        return full, len(self.ids)
