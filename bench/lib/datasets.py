"""Request traces for the load client: prompts plus the output length each asks for.

Length generators are pure functions of a numpy Generator, so a seed fixes the
trace; `sample_rows` turns lengths into prompts with a tokenizer. Nothing is
ever downloaded: `sharegpt` reads a local file given with --dataset-path.

Two traces exercise a prefix cache: `generated-shared-prefix` (SGLang's: groups
of prompts that share a random system prompt) and `multi-turn` (conversations
whose every turn resends the whole conversation so far). A multi-turn trace is
only the users' questions: each answer comes from the server, so the client
builds turn k+1's prompt once turn k has been answered (bench_serving's
`run_conversations`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

DATASETS = ("random", "random-ids", "exponential", "chapter-example", "sharegpt", "generated-shared-prefix",
            "multi-turn")

GSP_SEPARATOR = "\n\n"  # between a group's system prompt and each question, as SGLang joins them

# A conversation is rendered as ChatML text (SmolLM2's, the default model's, format; plain
# characters to other tokenizers). A turn's prompt ends where the answer starts, and the next
# turn's prompt is that prompt + the answer + ANSWER_END + the next question: every prompt
# begins with the whole previous prompt, which is what a prefix cache can reuse.
USER_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
ANSWER_END = "<|im_end|>\n"

# The chapter's eight-request batch: "some one-line answers, one long
# explanation", output lengths summing to 1968 with a longest of 1024, so a
# static batch computes 8 x 1024 = 8192 row-steps and keeps 1968 (0.240). The
# chapter's table did not survive in our copy of the text (only the sum, the
# maximum and the ratio did); these eight lengths are chosen to match them
# exactly, and stay integers when scaled by 1/2, 1/4 or 1/8.
CHAPTER_OUTPUT_LENS: tuple[int, ...] = (16, 40, 64, 96, 152, 224, 352, 1024)


class TextTokenizer(Protocol):
    """What the traces need of a tokenizer (tokenizer_proc's Tokenizer fits)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DatasetRow:
    prompt: str | list[int]  # text, or token ids (random-ids)
    prompt_len: int  # tokens, by the client's tokenizer
    output_len: int  # max_new_tokens asked for
    group: int = -1  # generated-shared-prefix: which system prompt the row starts with
    prefix_len: int = 0  # generated-shared-prefix: tokens of that system prompt (client's count)


@dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation: the user's questions, in order; every answer
    is asked for with output_len tokens and comes from the server."""

    questions: tuple[str, ...]
    question_lens: tuple[int, ...]  # tokens of each question, by the client's tokenizer
    output_len: int


def turn_prompt(history: str, question: str) -> str:
    """The prompt of a turn: the conversation so far (earlier prompts and
    answers, see `next_history`) and the new question, up to the answer."""
    return history + USER_TURN.format(question)


def next_history(prompt: str, answer: str) -> str:
    """The conversation after a turn's answer: that turn's prompt, the answer
    as the server returned it, and the end of the assistant's turn."""
    return prompt + answer + ANSWER_END


# ---- lengths ------------------------------------------------------------------------------


def uniform_lens(rng: np.random.Generator, n: int, full_len: int, range_ratio: float) -> list[int]:
    """SGLang's --random-range-ratio: uniform in [full_len * ratio, full_len]."""
    if full_len < 1:
        raise ValueError("lengths must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    low = max(1, int(full_len * range_ratio))
    return [int(x) for x in rng.integers(low, full_len + 1, size=n)]


def exponential_lens(rng: np.random.Generator, n: int, mean: float, max_len: int | None = None) -> list[int]:
    """The chapter's length model: i.i.d. exponential of the given mean, rounded
    to whole tokens (at least one; at most max_len when given). Rounding, not
    ceil, keeps the sample mean on `mean` (ceil would add half a token)."""
    if mean <= 0:
        raise ValueError("the mean output length must be > 0")
    lens = np.maximum(1, np.rint(rng.exponential(mean, size=n))).astype(int)
    if max_len is not None:
        lens = np.minimum(lens, max_len)
    return [int(x) for x in lens]


def chapter_lens(scale: float = 1.0, num: int = len(CHAPTER_OUTPUT_LENS)) -> list[int]:
    """The chapter's batch shrunk by `scale` (for a CPU), repeated to `num` rows."""
    if scale <= 0:
        raise ValueError("--chapter-scale must be > 0")
    scaled = [max(1, round(n * scale)) for n in CHAPTER_OUTPUT_LENS]
    return [scaled[i % len(scaled)] for i in range(num)]


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """Send offsets (s from the start) of a Poisson process; rate inf: all at 0."""
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, size=n))]


# ---- prompts ------------------------------------------------------------------------------


def special_ids(tokenizer: Any) -> set[int]:
    """Ids never to put in a random prompt (chat markers, EOS, ...)."""
    inner = getattr(tokenizer, "tok", tokenizer)  # tokenizer_proc's HFTokenizer wraps AutoTokenizer
    ids = set(getattr(inner, "all_special_ids", []) or [])
    ids.update(getattr(tokenizer, "eos_token_ids", []) or [])
    return ids


def random_ids(rng: np.random.Generator, length: int, vocab_size: int, banned: set[int]) -> list[int]:
    ids = rng.integers(0, vocab_size, size=length * 2 + 8)
    picked = [int(i) for i in ids if int(i) not in banned][:length]
    while len(picked) < length:  # a vocabulary mostly banned: top up slowly
        i = int(rng.integers(0, vocab_size))
        if i not in banned:
            picked.append(i)
    return picked


def text_prompt(tokenizer: TextTokenizer, ids: list[int]) -> tuple[str, int]:
    """Random ids as text, and its length when the server tokenises it again
    (decode then encode is not always the identity)."""
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def rows_from_lengths(rng: np.random.Generator, tokenizer: TextTokenizer, input_lens: Sequence[int],
                      output_lens: Sequence[int], as_ids: bool) -> list[DatasetRow]:
    banned = special_ids(tokenizer)
    rows = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = random_ids(rng, n_in, tokenizer.vocab_size, banned)
        if as_ids:
            rows.append(DatasetRow(ids, len(ids), n_out))
        else:
            text, n = text_prompt(tokenizer, ids)
            rows.append(DatasetRow(text, n, n_out))
    return rows


def sharegpt_rows(path: str, tokenizer: TextTokenizer, rng: np.random.Generator, num: int,
                  fixed_output_len: int | None = None, context_len: int = 2048) -> list[DatasetRow]:
    """ShareGPT JSON (a list of {"conversations": [{"from"|"role", "value"|"content"}, ...]}):
    each conversation's first turn is the prompt and the second turn's length the
    output length; SGLang's filters drop very short pairs and pairs over the context."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2:
            first, second = (t.get("value", t.get("content", "")) for t in turns[:2])
            pairs.append((first, second))
    order = rng.permutation(len(pairs))
    rows: list[DatasetRow] = []
    for k in order:
        if len(rows) == num:
            break
        prompt, answer = pairs[int(k)]
        n_in = len(tokenizer.encode(prompt))
        n_out = fixed_output_len or len(tokenizer.encode(answer))
        if n_in < 4 or n_out < 4 or n_in + n_out > context_len:
            continue
        rows.append(DatasetRow(prompt, n_in, n_out))
    if len(rows) < num:
        raise ValueError(f"{path} has only {len(rows)} usable conversations, {num} asked for")
    return rows


def shared_prefix_rows(rng: np.random.Generator, tokenizer: TextTokenizer, num_groups: int,
                       prompts_per_group: int, system_prompt_len: int, question_len: int,
                       output_len: int) -> list[DatasetRow]:
    """SGLang's generated-shared-prefix: num_groups random system prompts of
    system_prompt_len tokens, each followed (after GSP_SEPARATOR) by
    prompts_per_group random questions of question_len tokens; every output is
    output_len tokens. Text, as `random`, from random ids; the rows are
    shuffled, so a group's prompts do not arrive back to back. The counts are
    the client tokenizer's on the text (decode then encode is not always the
    identity)."""
    if min(num_groups, prompts_per_group, system_prompt_len, question_len, output_len) < 1:
        raise ValueError("the --gsp-* counts and lengths must be >= 1")
    banned = special_ids(tokenizer)
    rows = []
    for group in range(num_groups):
        system, prefix_len = text_prompt(tokenizer, random_ids(rng, system_prompt_len, tokenizer.vocab_size, banned))
        for _ in range(prompts_per_group):
            question = tokenizer.decode(random_ids(rng, question_len, tokenizer.vocab_size, banned))
            prompt = system + GSP_SEPARATOR + question
            rows.append(DatasetRow(prompt, len(tokenizer.encode(prompt)), output_len, group, prefix_len))
    return [rows[int(i)] for i in rng.permutation(len(rows))]


def conversations(rng: np.random.Generator, tokenizer: TextTokenizer, num: int, turns: int,
                  question_len: int, output_len: int) -> list[Conversation]:
    """`num` conversations of `turns` random questions of question_len tokens each."""
    if min(num, turns, question_len, output_len) < 1:
        raise ValueError("the --multi-turn-* counts and lengths must be >= 1")
    banned = special_ids(tokenizer)
    convs = []
    for _ in range(num):
        qs = [text_prompt(tokenizer, random_ids(rng, question_len, tokenizer.vocab_size, banned))
              for _ in range(turns)]
        convs.append(Conversation(tuple(q for q, _ in qs), tuple(n for _, n in qs), output_len))
    return convs


def sample_conversations(tokenizer: TextTokenizer, *, num: int, turns: int, question_len: int,
                         output_len: int, seed: int) -> list[Conversation]:
    return conversations(np.random.default_rng(seed), tokenizer, num, turns, question_len, output_len)


def sample_rows(name: str, tokenizer: TextTokenizer, *, num: int, seed: int, input_len: int,
                output_len: int, range_ratio: float = 0.0, chapter_scale: float = 1.0,
                exponential_max_len: int | None = None, dataset_path: str | None = None,
                sharegpt_output_len: int | None = None, sharegpt_context_len: int = 2048,
                gsp: dict[str, int] | None = None) -> list[DatasetRow]:
    """The trace --dataset-name asks for. For `exponential`, output_len is the
    mean; prompts are uniform as in `random`. `chapter-example` fixes the output
    lengths (scaled) and uses input_len for every prompt.
    `generated-shared-prefix` takes its sizes from `gsp` (shared_prefix_rows'
    keyword arguments) and ignores num, input_len and output_len, as SGLang
    does. `multi-turn` is not a list of rows: see `sample_conversations`."""
    rng = np.random.default_rng(seed)
    if name == "generated-shared-prefix":
        if gsp is None:
            raise ValueError("generated-shared-prefix needs its sizes (gsp=...)")
        return shared_prefix_rows(rng, tokenizer, **gsp)
    if name == "multi-turn":
        raise ValueError("multi-turn is a set of conversations: use sample_conversations")
    if name == "sharegpt":
        if not dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (nothing is downloaded)")
        return sharegpt_rows(dataset_path, tokenizer, rng, num, sharegpt_output_len, sharegpt_context_len)
    if name == "chapter-example":
        outs = chapter_lens(chapter_scale, num)
        ins = [input_len] * num
    elif name == "exponential":
        ins = uniform_lens(rng, num, input_len, range_ratio)
        outs = exponential_lens(rng, num, output_len, exponential_max_len)
    elif name in ("random", "random-ids"):
        ins = uniform_lens(rng, num, input_len, range_ratio)
        outs = uniform_lens(rng, num, output_len, range_ratio)
    else:
        raise ValueError(f"unknown dataset {name!r}; one of {', '.join(DATASETS)}")
    return rows_from_lengths(rng, tokenizer, ins, outs, as_ids=(name == "random-ids"))
