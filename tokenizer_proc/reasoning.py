"""Reasoning output (`--reasoning-parser`): a model's thinking, written between
`<think>` and `</think>`, is split from its answer into `reasoning_content`
(vLLM's field name, which SGLang also uses).

- `deepseek-r1`: the output starts inside the thinking block: its chat
  template writes `<think>` into the prompt, so the output may lack the
  opening tag (it is dropped when the model writes it anyway). An output that
  never closes the block is all reasoning.
- `qwen3`: the block is optional: reasoning only when the output opens with
  `<think>` (after whitespace), or when the prompt itself ends with an open
  `<think>` (the template opened it); otherwise all of it is content.

Both: the content is the text after `</think>` with its leading whitespace
dropped (models write `</think>\n\n`); the reasoning is the text between
the tags as written. `ReasoningSplitter` works incrementally: a tag split
across stream chunks, at any character, is held back until it is whole, so
thinking never leaks into `content` nor the answer into `reasoning_content`,
and the stream adds up to the unstreamed split.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.messages import ThinkingBudgetSpec
from tokenizer_proc.errors import BadRequestError

if TYPE_CHECKING:
    from common.server_args import ServerArgs
    from tokenizer_proc.openai_protocol import OpenAIInput
    from tokenizer_proc.tokenizer import Tokenizer

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


class ReasoningParser(enum.StrEnum):
    DEEPSEEK_R1 = "deepseek-r1"
    QWEN3 = "qwen3"

    @property
    def starts_in_reasoning(self) -> bool:
        """The output is thinking from its first token, opening tag or not."""
        return self is ReasoningParser.DEEPSEEK_R1


class _Phase(enum.Enum):
    START = "start"  # nothing but whitespace yet: an opening tag may still come
    REASONING = "reasoning"  # inside the block: waiting for the closing tag
    CONTENT_START = "content_start"  # just after the closing tag: leading whitespace is dropped
    CONTENT = "content"


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


# prompt tokens decoded to see whether the template opened a thinking block
PROMPT_TAIL_TOKENS = 8


def reasoning_parser(args: ServerArgs, inp: OpenAIInput) -> ReasoningParser | None:
    """The parser a chat request's output goes through: the server's, unless
    the request asks for no separation (separate_reasoning false)."""
    if not args.reasoning_parser or (inp.chat is not None and inp.chat.separate_reasoning is False):
        return None
    return ReasoningParser(args.reasoning_parser)


def attach_thinking_budget(inp: OpenAIInput, server_parser: str, tokenizer: Tokenizer) -> None:
    """A chat request's thinking_budget, as each of its scheduler requests'
    ThinkingBudgetSpec: the closing tag's tokens to force, and whether the
    thinking is open from the first output token or opens with the opening
    tag's token (scheduler_proc/thinking_budget.py)."""
    budget = inp.chat.thinking_budget if inp.chat is not None else None
    if budget is None:
        return
    if not server_parser:
        raise BadRequestError("thinking_budget needs a reasoning model: start the server with --reasoning-parser")
    parser = ReasoningParser(server_parser)
    end_ids = tokenizer.encode(CLOSE_TAG, add_special_tokens=False)
    open_tag = tokenizer.encode(OPEN_TAG, add_special_tokens=False)
    for spec in inp.specs:
        if spec.req.sampling_params.grammar is not None:
            # tool calls are constrained by a grammar too (tokenizer_proc/tools.py)
            raise BadRequestError("thinking_budget cannot be combined with response_format, a grammar, "
                                  "or tools that constrain the answer")
        start_id = -1
        if not parser.starts_in_reasoning and not ReasoningSplitter.for_prompt(
                parser, spec.req.input_ids, tokenizer).in_reasoning_from_start:
            if len(open_tag) != 1:
                raise BadRequestError(f"thinking_budget: {OPEN_TAG} is not one token of this model's tokenizer")
            start_id = open_tag[0]
        spec.req.thinking_budget = ThinkingBudgetSpec(budget=budget, end_ids=end_ids, start_id=start_id)


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """The rendered prompt ends inside a thinking block (its template wrote
    `<think>` after the assistant's turn opener)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN_TAG)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feeds text deltas in, gets (reasoning, content) deltas out."""

    def __init__(self, parser: ReasoningParser, prompt_opens: bool = False) -> None:
        self.in_reasoning_from_start = parser.starts_in_reasoning or prompt_opens
        self.phase = _Phase.START
        self.held = ""  # text not yet given to either side (a possible tag, leading whitespace)

    @classmethod
    def for_prompt(cls, parser: ReasoningParser, prompt_ids: list[int], tokenizer: Tokenizer) -> ReasoningSplitter:
        """A splitter for the output of this prompt (whose end may open the block)."""
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return cls(parser, prompt_opens_thinking(tail))

    def whole(self, text: str) -> Split:
        """A whole output at once (a fresh splitter's)."""
        out = self.feed(text)
        out += self.flush()
        return out

    def feed(self, delta: str) -> Split:
        out = Split()
        text = self.held + delta
        self.held = ""
        while text:
            text = self._step(text, out)
        return out

    def _step(self, text: str, out: Split) -> str:
        """Consumes a prefix of `text` in the current phase; returns the rest
        (empty when all of it was consumed or held back)."""
        if self.phase is _Phase.START:
            stripped = text.lstrip()
            if stripped.startswith(OPEN_TAG):
                self.phase = _Phase.REASONING
                return stripped[len(OPEN_TAG):]
            if OPEN_TAG.startswith(stripped):  # whitespace, or a tag still arriving
                self.held = text
                return ""
            self.phase = _Phase.REASONING if self.in_reasoning_from_start else _Phase.CONTENT
            return text
        if self.phase is _Phase.REASONING:
            end = text.find(CLOSE_TAG)
            if end >= 0:
                out.reasoning += text[:end]
                self.phase = _Phase.CONTENT_START
                return text[end + len(CLOSE_TAG):]
            keep = _partial_suffix(text, CLOSE_TAG)
            out.reasoning += text[:len(text) - keep]
            self.held = text[len(text) - keep:]
            return ""
        if self.phase is _Phase.CONTENT_START:
            stripped = text.lstrip()
            if stripped:
                self.phase = _Phase.CONTENT
            return stripped
        out.content += text
        return ""

    def flush(self) -> Split:
        """The end of the output: whatever was held back goes to its side (an
        unfinished tag is text)."""
        held, self.held = self.held, ""
        if self.phase is _Phase.START:
            return Split(reasoning=held) if self.in_reasoning_from_start else Split(content=held)
        if self.phase is _Phase.REASONING:
            return Split(reasoning=held)
        return Split(content=held) if self.phase is _Phase.CONTENT else Split()


def split_reasoning(parser: ReasoningParser, text: str, prompt_opens: bool = False) -> Split:
    """The whole output at once: what a stream of it adds up to."""
    return ReasoningSplitter(parser, prompt_opens).whole(text)
