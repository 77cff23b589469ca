"""The front end never stalls: tokenizing and chat templates run on the
tokenizer pool's threads, never on the event loop, and every limit that needs
no tokens is checked before anything is tokenized."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_proc.server_harness import CONTEXT_LEN, Server, post, sse_events, wait_until
from tokenizer_proc.protocol import MAX_N, MAX_OUTPUTS
from tokenizer_proc.tokenizer import Tokenizer, load_tokenizer
from tokenizer_proc.validation import MAX_RID_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS

SLOW_S = 1.0


class SlowTokenizer:
    """The test tokenizer, but a prompt holding "SLOW" takes SLOW_S to encode
    (or to template), like a prompt of megabytes; it counts its calls."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.eos_token_ids, self.vocab_size = tok.eos_token_ids, tok.vocab_size
        self.max_token_chars = tok.max_token_chars
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if "SLOW" in text:
            time.sleep(SLOW_S)
        return self.tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        self.calls += 1
        if any("SLOW" in m["content"] for m in messages):
            time.sleep(SLOW_S)
        return self.tok.apply_chat_template(messages)


@pytest.fixture(scope="module")
def slow_server(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(SlowTokenizer(load_tokenizer(str(sp_model_file))), tmp_path_factory.mktemp("ipc"))
    yield srv
    srv.stop()


def loop_lag(server: Server, during: Any) -> float:
    """The server loop's longest pause (beyond a 5 ms sleep) while `during()` runs."""
    async def ticker(stop: asyncio.Event) -> float:
        worst = 0.0
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t - 0.005)
        return worst

    stop = asyncio.Event()
    fut = asyncio.run_coroutine_threadsafe(ticker(stop), server.loop)
    try:
        during()
    finally:
        server.loop.call_soon_threadsafe(stop.set)
    return fut.result(timeout=10)


SLOW_BODIES = [
    ("/generate", {"text": "SLOW once upon a time", "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/completions", {"prompt": "SLOW once upon a time", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW hello"}], "max_tokens": 4}),
]


@pytest.mark.parametrize("path,body", SLOW_BODIES, ids=[p for p, _ in SLOW_BODIES])
def test_a_slow_prompt_delays_only_its_own_request(slow_server: Server, path: str, body: dict[str, Any]) -> None:
    quick = {"text": "once upon a time", "sampling_params": {"max_new_tokens": 4}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = pool.submit(post, slow_server, body, path)
        time.sleep(0.1)  # the slow one is being tokenized
        t0 = time.perf_counter()
        fast = [pool.submit(post, slow_server, quick) for _ in range(3)]
        assert all(f.result()[0] == 200 for f in fast)
        quick_s = time.perf_counter() - t0
        assert not slow.done()  # still tokenizing while the others were served
        assert slow.result()[0] == 200
    assert quick_s < SLOW_S / 2, quick_s


def test_the_event_loop_runs_on_while_a_prompt_is_tokenized(slow_server: Server) -> None:
    lag = loop_lag(slow_server, lambda: [post(slow_server, b, p) for p, b in SLOW_BODIES])
    assert lag < SLOW_S / 4, lag  # tokenizing on the loop would pause it for SLOW_S


def limit_cases(char_limit: int) -> list[tuple[str, str, dict[str, Any], str]]:
    long_text = "a" * (char_limit + 1)
    sp = {"max_new_tokens": 4}
    return [
        ("text chars", "/generate", {"text": long_text, "sampling_params": sp}, "refused before tokenizing"),
        ("text list chars", "/generate", {"text": ["ok", long_text]}, "text[1] has"),
        ("prompt chars", "/v1/completions", {"prompt": long_text}, "refused before tokenizing"),
        ("chat chars", "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
         "refused before tokenizing"),
        ("prompts", "/generate", {"text": ["x"] * (MAX_OUTPUTS + 1)}, f"at most {MAX_OUTPUTS} prompts"),
        ("completion prompts", "/v1/completions", {"prompt": ["x"] * (MAX_OUTPUTS + 1)},
         f"at most {MAX_OUTPUTS} prompts"),
        ("n", "/generate", {"text": "x", "sampling_params": {"n": MAX_N + 1}}, "n must be in"),
        ("prompts x n", "/generate", {"text": ["x"] * 9, "sampling_params": {"n": MAX_N}},
         f"at most {MAX_OUTPUTS} outputs"),
        ("openai n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": MAX_N + 1},
         "n must be in"),
        ("rid", "/generate", {"text": "x", "rid": "r" * (MAX_RID_CHARS + 1)}, f"at most {MAX_RID_CHARS}"),
        ("rid list", "/generate", {"text": ["x", "y"], "rid": ["a", "r" * (MAX_RID_CHARS + 1)]},
         f"at most {MAX_RID_CHARS}"),
        ("stop count", "/generate",
         {"text": "x", "sampling_params": {"stop": [str(k) for k in range(MAX_STOP_STRINGS + 1)]}},
         f"at most {MAX_STOP_STRINGS} strings"),
        ("stop length", "/v1/completions", {"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)},
         f"at most {MAX_STOP_CHARS} characters"),
        ("ids past the context", "/generate", {"input_ids": [5] * (CONTEXT_LEN + 1)}, "context length"),
        ("chat ids past the context", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "input_ids": [5] * (CONTEXT_LEN + 1)},
         "context length"),
        ("sampling", "/v1/completions", {"prompt": "x", "temperature": 5}, "temperature must be in"),
        ("stop regex RE2 cannot take", "/generate", {"text": "x", "sampling_params": {"stop_regex": r"(a)\1"}},
         "stop_regex: '(a)\\\\1': backreferences"),
        ("openai stop regex", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "stop_regex": ["ok", "a(?=b)"]}, "'a(?=b)': lookahead"),
    ]


def test_every_limit_is_checked_before_tokenizing(slow_server: Server) -> None:
    tok = slow_server.tokenizer
    limit = CONTEXT_LEN * tok.max_token_chars
    for name, path, body, message in limit_cases(limit):
        before = tok.calls
        status, _, raw = post(slow_server, body, path)
        assert status == 400, (name, raw[:300])
        assert message in json.loads(raw)["error"]["message"], (name, raw[:300])
        assert tok.calls == before, f"{name}: tokenized before it was refused"


def test_a_prompt_at_the_character_limit_is_tokenized_and_checked_against_the_context(
        slow_server: Server) -> None:
    limit = CONTEXT_LEN * slow_server.tokenizer.max_token_chars
    status, _, raw = post(slow_server, {"text": "a b " * (limit // 4)})
    assert status == 400 and "context length" in json.loads(raw)["error"]["message"], raw[:300]


def test_huge_prompts_do_not_pause_the_loop(slow_server: Server) -> None:
    """10 clients post 4 MiB prompts at once: the loop's longest pause grows by
    at most 100 ms (each body is read in chunks and decoded by msgspec, a few
    ms; nothing tokenizes it)."""
    text = "The quick brown fox jumps over the lazy dog. " * (4 * 2**20 // 45)
    bodies = [("/generate", json.dumps({"text": text}).encode()),
              ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}]}).encode())]

    def posts() -> None:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            for status, _, raw in pool.map(lambda k: post(slow_server, bodies[k % 2][1], bodies[k % 2][0]),
                                           range(10)):
                assert status == 400 and b"refused before tokenizing" in raw, raw[:300]

    quiet = loop_lag(slow_server, lambda: time.sleep(1.0))
    loaded = loop_lag(slow_server, posts)
    assert loaded - quiet < 0.1, (quiet, loaded)


def burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_stop_matching_runs_off_the_event_loop(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop matcher that takes 50 ms a token (RE2 releases the GIL while it
    searches, as this sleep does): it runs on the matching pool's threads, so
    the loop runs on, and the stream's events still come in order."""
    from tokenizer_proc.stop_strings import StopStringMatcher

    feed, threads = StopStringMatcher.feed, set()

    def slow_feed(self: StopStringMatcher, delta: str) -> str:
        threads.add(threading.current_thread().name)
        if "SLOW" in self.stops:
            time.sleep(0.05)
        return feed(self, delta)

    monkeypatch.setattr(StopStringMatcher, "feed", slow_feed)
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 12, "stop": ["SLOW"]}}
    results: list[Any] = []
    quiet = loop_lag(server, lambda: time.sleep(0.6))
    lag = loop_lag(server, lambda: results.append(post(server, body)))
    status, _, raw = results[0]
    assert status == 200
    texts = [e["text"] for e in sse_events(raw)]
    assert len(texts) >= 2 and all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    assert threads and all(name.startswith("front-worker") for name in threads), threads
    # on the loop, each 3-token chunk would pause it for 150 ms
    assert lag - quiet < 0.1, (quiet, lag)


def test_a_request_past_its_matching_budget_ends_as_an_abort(server: Server,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizer_proc import request_output
    from tokenizer_proc.stop_strings import StopStringMatcher

    feed = StopStringMatcher.feed

    def slow_feed(self: StopStringMatcher, delta: str) -> str:
        burn_cpu(0.03)  # CPU time: the budget's measure
        return feed(self, delta)

    monkeypatch.setattr(StopStringMatcher, "feed", slow_feed)
    monkeypatch.setattr(request_output, "MATCH_BUDGET_S", 0.05)
    monkeypatch.setattr(request_output, "MATCH_BUDGET_PER_TOKEN_S", 0.0)
    # "hang...": the fake scheduler sends 3 tokens, then waits for the abort
    status, _, raw = post(server, {"text": "hi", "rid": "hang-over-budget",
                                   "sampling_params": {"max_new_tokens": 30, "stop_regex": "never here"}})
    assert status == 200, raw[:300]
    out = json.loads(raw)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "CPU budget" in reason["message"], reason
    assert 2 <= out["meta_info"]["completion_tokens"] <= 3  # ended once past its budget
    wait_until(lambda: "hang-over-budget" in server.fake.aborts())  # the scheduler told: its KV freed
    monkeypatch.undo()
    ok = post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 4, "stop_regex": "never here"}})
    assert ok[0] == 200 and json.loads(ok[2])["meta_info"]["finish_reason"]["type"] != "abort"
