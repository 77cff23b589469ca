"""Incremental detokenization for streaming.

Decoding token by token is wrong twice over: one character may span several
byte tokens (decoding half of it gives U+FFFD), and a token's text can depend
on its left neighbour (SentencePiece word-start spaces). So each step decodes
a short window twice, `ids[prefix_offset:read_offset]` (text already sent) and
`ids[prefix_offset:]`, and emits the difference; the window slides forward
only once the new text is complete.
"""

from __future__ import annotations

from tokenizer_proc.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the tokens being read
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""  # everything emitted so far

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
        if len(full) <= len(sent):
            return ""  # nothing new (e.g. a skipped special token)
        if full.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character split across tokens: wait for the rest
        delta = full[len(sent):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
