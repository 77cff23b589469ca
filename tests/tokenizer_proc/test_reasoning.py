"""Splitting a reasoning model's output into reasoning_content and content,
whole and streamed, on texts as DeepSeek-R1 and Qwen3 write them."""

from __future__ import annotations

import random

import pytest

from tokenizer_proc.reasoning import (ReasoningParser, ReasoningSplitter, Split, prompt_opens_thinking,
                                      split_reasoning)

R1, QWEN3 = ReasoningParser.DEEPSEEK_R1, ReasoningParser.QWEN3

# (parser, prompt ends with an open <think>, output as generated, reasoning, content)
RECORDED = [
    # DeepSeek-R1: the template wrote "<think>\n", the output starts inside the block
    (R1, True, "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**.", "Okay, 2 + 2 is 4.\n", "The answer is **4**."),
    # DeepSeek-R1 writing its own opening tag anyway
    (R1, False, "<think>\nHmm, <b> is a tag; a < b.\n</think>\n\n4", "\nHmm, <b> is a tag; a < b.\n", "4"),
    # DeepSeek-R1 cut off by max_tokens inside its thinking: all reasoning
    (R1, False, "Let me think about </thi", "Let me think about </thi", ""),
    # Qwen3 thinking
    (QWEN3, False, "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "Hello! How can I help?"),
    # Qwen3 without a thinking block (enable_thinking false; the template wrote an empty one)
    (QWEN3, False, "Hello! <think> is just text here. </think>", "", "Hello! <think> is just text here. </think>"),
    # Qwen3 whose template opened the block in the prompt
    (QWEN3, True, "short thought</think>Answer: <3", "short thought", "Answer: <3"),
    # Qwen3 answering with text that starts like a tag
    (QWEN3, False, "<thin ice", "", "<thin ice"),
    # non-ASCII on both sides of the tags
    (QWEN3, False, "  <think>é🙂 ü</think>\n ñ🙂", "é🙂 ü", "ñ🙂"),
]


@pytest.mark.parametrize("parser,opens,text,reasoning,content", RECORDED)
def test_whole_output_splits_into_reasoning_and_content(parser: ReasoningParser, opens: bool, text: str,
                                                        reasoning: str, content: str) -> None:
    assert split_reasoning(parser, text, opens) == Split(reasoning, content)


def _stream(parser: ReasoningParser, opens: bool, pieces: list[str]) -> tuple[list[Split], Split]:
    splitter = ReasoningSplitter(parser, opens)
    deltas = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    total = Split()
    for d in deltas:
        total += d
    return deltas, total


@pytest.mark.parametrize("parser,opens,text,reasoning,content", RECORDED)
def test_a_tag_split_at_every_position_never_leaks_into_the_other_side(
        parser: ReasoningParser, opens: bool, text: str, reasoning: str, content: str) -> None:
    data = text.encode()
    for cut in range(len(data) + 1):
        # cut at every byte; a cut inside a character gives its bytes to the next piece,
        # as the incremental detokenizer holds back a split character
        head = data[:cut].decode(errors="ignore")
        pieces = [head, text[len(head):]]
        deltas, total = _stream(parser, opens, pieces)
        assert total == Split(reasoning, content), cut
        # what came out so far is always a prefix of each side: nothing given to the wrong side
        acc = Split()
        for d in deltas:
            acc += d
            assert reasoning.startswith(acc.reasoning) and content.startswith(acc.content), cut


@pytest.mark.parametrize("parser,opens,text,reasoning,content", RECORDED)
def test_a_character_at_a_time_and_random_pieces_add_up_to_the_whole_split(
        parser: ReasoningParser, opens: bool, text: str, reasoning: str, content: str) -> None:
    assert _stream(parser, opens, list(text))[1] == Split(reasoning, content)
    rng = random.Random(1234)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        deltas, total = _stream(parser, opens, pieces)
        assert total == Split(reasoning, content), pieces
        acc = Split()
        for d in deltas:
            acc += d
            assert reasoning.startswith(acc.reasoning) and content.startswith(acc.content), pieces


def test_the_prompt_opens_thinking_when_it_ends_with_an_open_tag() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
