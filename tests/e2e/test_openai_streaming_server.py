"""The `openai` client's own stream accumulation, on a real server, adds up to
the unstreamed answer for requests that fan out: chat with n = 2 (seeded
sampling, so each choice differs and is reproducible), completions with a
list of prompts, n = 2 and logprobs (greedy, so prompt i's text is fixed).
A choice sent under another's index, logprobs split wrongly between chunks,
or a usage chunk of the wrong shape makes the accumulated answer differ."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.server_process import ServerProcess
from tests.helpers import make_tiny_llama

MODEL = "org/tiny-llama"  # a Hugging Face style id, with its slash
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def client(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    # a tiny random model with the default tokenizer's vocabulary, so text prompts fit it
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny_vocab")), vocab_size=49152)
    srv = ServerProcess("--model-path", model, "--tokenizer-path", default_model_dir,
                        "--served-model-name", MODEL, "--dtype", "float32")
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield c
    finally:
        c.close()
        srv.kill()


def test_model_is_found_by_its_id(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL


def test_streamed_chat_with_n_accumulates_to_the_answer(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=2,
                                max_tokens=12, temperature=1.0, seed=1234, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args, stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        acc = stream.current_completion_snapshot
    assert [c.message.content for c in whole.choices][0] != whole.choices[1].message.content  # two samples
    assert len(acc.choices) == 2
    for got, want in zip(acc.choices, whole.choices):
        assert got.index == want.index
        assert got.message.content == want.message.content and got.message.role == "assistant"
        assert got.finish_reason == want.finish_reason
        assert_same_logprobs([t.model_dump() for t in got.logprobs.content],
                             [t.model_dump() for t in want.logprobs.content])
    assert acc.usage is not None and acc.usage.completion_tokens == whole.usage.completion_tokens
    assert acc.usage.prompt_tokens == whole.usage.prompt_tokens


def assert_same_logprobs(got: Any, want: Any) -> None:
    """Equal, but for float noise (a batch's composition moves a logprob in
    its last bits)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-3)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same_logprobs(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_logprobs(a, b)
    else:
        assert got == want


def accumulate_completions(chunks: list[Any]) -> tuple[dict[int, dict[str, Any]], Any]:
    """Per index: text, finish reason and logprobs lists, added up as OpenAI
    clients do for the legacy completions stream; and the final usage."""
    per: dict[int, dict[str, Any]] = {}
    usage = None
    for i, chunk in enumerate(chunks):
        if chunk.usage is not None:
            assert i == len(chunks) - 1 and chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            acc = per.setdefault(c.index, {"text": "", "finish_reason": None, "tokens": [], "token_logprobs": [],
                                           "top_logprobs": [], "text_offset": []})
            assert acc["finish_reason"] is None, "a chunk after the choice finished"
            acc["text"] += c.text
            acc["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    acc[key] += getattr(c.logprobs, key)
    return per, usage


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completions_of_prompt_list_accumulate_to_the_answer(client: openai.OpenAI, echo: bool) -> None:
    args: dict[str, Any] = dict(model=MODEL, prompt=PROMPTS, n=2, max_tokens=10, temperature=0, logprobs=2,
                                echo=echo)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    per, usage = accumulate_completions(chunks)
    assert sorted(per) == list(range(len(PROMPTS) * 2))
    assert len({whole.choices[2 * i].text for i in range(len(PROMPTS))}) == len(PROMPTS)  # prompt-major order
    for want in whole.choices:
        got = per[want.index]
        assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert_same_logprobs(got[key], getattr(want.logprobs, key))
    assert usage is not None
    want_usage = whole.usage.model_dump()
    if not echo:  # `whole` just cached these prompts: each is reused but for its last token
        want_usage["prompt_tokens_details"]["cached_tokens"] = whole.usage.prompt_tokens - len(PROMPTS)
    # (echo needs every prompt token's logprob, so nothing is taken from the cache)
    assert usage.model_dump() == want_usage
