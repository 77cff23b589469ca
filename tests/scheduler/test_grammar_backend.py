"""The scheduler's grammar compiles, with the real xgrammar and the default
model's tokenizer: a small grammar passes queued large ones, a cached one
never waits, a compile past its budget fails its requests and hands its
place to a fresh thread, a queued compile nobody waits for is dropped, and
the compiled-grammar cache stays under its byte bound."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.messages import Grammar, GrammarKind
from common.server_args import ServerArgs
from scheduler_proc.grammar import CompileJob, GrammarBackend, GrammarFailure

ONE_FIELD = Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "string"}}}')


def enum_schema(values: int, tag: str) -> Grammar:
    """A one-property schema whose enum strings make the compile slow (past a
    few thousand strings, xgrammar's time and size grow steeply)."""
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"a": {"enum": [f"value-{i}-{tag}" for i in range(values)]}},
         "required": ["a"]}))


def wait_for(backend: GrammarBackend, job: CompileJob, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while (outcome := backend.outcome(job)) is None:
        assert time.monotonic() < deadline, "the compile never ended"
        time.sleep(0.005)
    return outcome


@pytest.fixture
def make_backend(default_model_dir: str) -> Iterator[Callable[..., GrammarBackend]]:
    vocab_size = json.loads((Path(default_model_dir) / "config.json").read_text())["vocab_size"]
    made: list[GrammarBackend] = []

    def make(**args: Any) -> GrammarBackend:
        backend = GrammarBackend(default_model_dir, vocab_size, [2],
                                 ServerArgs(model_path=default_model_dir, **args))
        made.append(backend)
        return backend
    yield make
    for backend in made:
        backend.shutdown()


class Gate:
    """Holds the compile of the grammars it names until opened (no CPU spent),
    and records every grammar compiled."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: set[str]) -> None:
        self.opened = threading.Event()
        self.held = held
        self.compiled: list[str] = []
        real = GrammarBackend._compile

        def compile_(backend: GrammarBackend, grammar: Grammar) -> Any:
            self.compiled.append(grammar.text)
            if grammar.text in self.held:
                assert self.opened.wait(60)
            return real(backend, grammar)
        monkeypatch.setattr(GrammarBackend, "_compile", compile_)


def test_a_one_field_schema_passes_queued_large_schemas_and_a_cached_one_never_waits(make_backend):
    backend = make_backend(grammar_compile_threads=1)
    warm = backend.compile(ONE_FIELD)  # loads the vocabulary, and caches the one-field schema
    assert not isinstance(wait_for(backend, warm), GrammarFailure)
    large = [backend.compile(enum_schema(8000, str(k))) for k in range(4)]
    while large[0].started_at is None:
        time.sleep(0.005)
    small = backend.compile(Grammar(GrammarKind.REGEX, r"[0-9]{4}"))  # after the four, and not cached
    assert small.future.done() is False
    again = backend.compile(ONE_FIELD)
    assert again.future.done(), "a cached grammar waits behind nothing"
    assert not isinstance(wait_for(backend, small), GrammarFailure)
    # compiled right after the one running: the large ones queued before it still wait
    assert [job.started_at is None for job in large[2:]] == [True, True]
    for job in large:
        backend.release(job)  # their clients left: the queued ones are dropped
    assert backend.queued == 0 and all(job.future.cancelled() for job in large[2:])


def test_a_compile_past_its_budget_fails_its_requests_and_a_fresh_thread_takes_its_place(
        make_backend, monkeypatch):
    slow = Grammar(GrammarKind.REGEX, "slow[a-z]+")
    gate = Gate(monkeypatch, {slow.text})
    backend = make_backend(grammar_compile_threads=1, grammar_compile_timeout_s=0.3)
    wait_for(backend, backend.compile(ONE_FIELD))  # the vocabulary is loaded (not a compile's time)
    first, second = backend.compile(slow), backend.compile(slow)  # two requests, one compile
    t0 = time.monotonic()
    out = wait_for(backend, first)
    assert isinstance(out, GrammarFailure) and "--grammar-compile-timeout-s" in out.message, out
    assert 0.3 <= time.monotonic() - t0 < 30
    assert wait_for(backend, second) == out
    # the held compile runs on, but a fresh thread serves the queue meanwhile
    quick = backend.compile(Grammar(GrammarKind.REGEX, "[a-z]{3}"))
    assert not isinstance(wait_for(backend, quick), GrammarFailure)
    assert not gate.opened.is_set()
    # the same grammar again is refused at once, without another compile
    repeat = backend.compile(slow)
    assert repeat.future.done() and backend.outcome(repeat) == out
    assert gate.compiled.count(slow.text) == 1
    gate.opened.set()


def test_a_queued_compile_nobody_waits_for_is_dropped(make_backend, monkeypatch):
    held = Grammar(GrammarKind.REGEX, "held[a-z]+")
    gate = Gate(monkeypatch, {held.text})
    backend = make_backend(grammar_compile_threads=1)
    running = backend.compile(held)
    while running.started_at is None:
        time.sleep(0.005)
    queued = Grammar(GrammarKind.REGEX, "queued[0-9]+")
    a, b = backend.compile(queued), backend.compile(queued)  # two requests share it
    assert a is b and backend.queued == 1
    backend.release(a)
    assert backend.queued == 1  # one request still waits for it
    backend.release(b)
    assert backend.queued == 0 and a.future.cancelled()
    backend.release(running)  # running: it cannot be stopped, and ends as usual
    gate.opened.set()
    assert not isinstance(wait_for(backend, running), GrammarFailure)
    assert queued.text not in gate.compiled
    fresh = backend.compile(queued)  # sent again later: compiled afresh
    assert fresh is not a and not isinstance(wait_for(backend, fresh), GrammarFailure)


def test_the_compiled_grammar_cache_stays_under_its_byte_bound(make_backend):
    bound = 600_000
    backend = make_backend(grammar_cache_bytes=bound)
    sizes = []
    jobs = []
    for k in range(12):  # ~126 KB each (xgrammar's count): 4 fit
        job = backend.compile(enum_schema(1000, str(k)))
        sizes.append(wait_for(backend, job).memory_size_bytes)
        jobs.append(job)
        assert backend.cached_bytes <= bound
    assert sum(sizes) > 2 * bound
    assert backend.cached_bytes == sum(g.memory_size_bytes for g in backend._compiled.values())
    assert backend.is_cached(enum_schema(1000, "11"))  # the latest is kept
    assert not backend.is_cached(enum_schema(1000, "0"))  # the oldest was dropped
    # a grammar larger than the whole bound is compiled for its requests, never kept
    tiny = make_backend(grammar_cache_bytes=sizes[0] // 2)
    assert not isinstance(wait_for(tiny, tiny.compile(enum_schema(1000, "0"))), GrammarFailure)
    assert tiny.cached_bytes == 0 and not tiny.is_cached(enum_schema(1000, "0"))


def test_drafts_are_cut_where_the_grammar_rejects_them_or_before_they_complete_it(make_backend,
                                                                                   default_model_dir):
    """Speculative decoding: allowed_prefix and fill_draft_bitmask leave the
    matcher where it was."""
    import torch
    from transformers import AutoTokenizer

    from scheduler_proc.grammar import ReqGrammar, fill_bitmask, fill_draft_bitmask

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    backend = make_backend()
    compiled = wait_for(backend, backend.compile(Grammar(GrammarKind.REGEX, r"ab(cd)+")))
    g = ReqGrammar(compiled)
    ids = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d", "c")]
    eos = 2
    before = fill_bitmask([g])
    assert g.allowed_prefix(ids[:2] + [tok.convert_tokens_to_ids("x")]) == 2  # "x" is rejected
    assert g.allowed_prefix(ids[:4] + [eos]) == 4  # the stop token would complete it: left to sample
    assert g.allowed_prefix(ids) == 5
    assert fill_bitmask([g]) == before  # the matcher is where it was
    masks = torch.full((4, (g.vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_draft_bitmask(masks, 0, g, ids[:3])
    masks = masks.numpy()
    allowed = [{t for t in (*ids, eos) if masks[j, t // 32] >> (t % 32) & 1} for j in range(4)]
    assert allowed == [{ids[0]}, {ids[1]}, {ids[2]}, {ids[3]}]  # one mask before each draft and after the last
    assert fill_bitmask([g]) == before
    for t in ids[:4]:
        assert g.accept(t)
    assert not g.terminated and g.accept(eos) and g.terminated
