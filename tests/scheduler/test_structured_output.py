"""Structured output on the real model (scheduler + model runner in one
process): seeded random JSON schemas, regexes and an EBNF grammar, greedy and
sampled, in a busy batch whose KV pool is small enough to retract rows; every
output parses and validates. Grammars compile off the loop: a request waiting
for its grammar holds up nobody."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import jsonschema
import pytest
import regex

from common.messages import AbortReq, Grammar, GrammarKind, SamplingParams, TokenizedGenerateReq
from scheduler_proc.grammar import GrammarBackend
from scheduler_proc.queries import scheduler_state
from tests.scheduler.test_engine_matches_transformers import Engine
from tokenizer_proc.finish_json import finish_json

# the server's default: bfloat16 where the CPU computes it natively, float32
# elsewhere (emulated, bfloat16 steps of the real model take ~4x as long)
DTYPE = "auto"
# The random-schema load: 12 schemas, each asked greedy and sampled (20 took ~8 s
# more of the suite), in a pool of 400 KV slots that retracts it 5 times
SCHEMAS = 12
POOL = 400


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema: nested objects, arrays, enums, numbers, booleans,
    strings, some fields required. Strings, arrays and numbers are bounded
    (xgrammar enforces maxLength, maxItems and numeric ranges), so that every
    answer, sampled too, fits in max_new_tokens."""
    def value(d: int) -> dict[str, Any]:
        kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if d < 2 else [])
        kind = rng.choice(kinds)
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(3, 16)}
        if kind == "integer":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
        if kind == "number":
            return {"type": "number", "minimum": -1000, "maximum": 1000}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", 1, 2, True, None], rng.randint(2, 4))}
        if kind == "array":
            return {"type": "array", "items": value(d + 1), "maxItems": rng.randint(1, 3)}
        return random_schema(rng, d + 1)

    names = rng.sample(["name", "age", "city", "score", "tags", "ok", "kind", "size", "info", "id"],
                       rng.randint(1, 4 if depth == 0 else 2))
    props = {n: value(depth) for n in names}
    return {"type": "object", "properties": props,
            "required": [n for n in names if rng.random() < 0.7],
            "additionalProperties": False}


@pytest.fixture(scope="module")
def chat(default_model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)

    def ids(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    ids.decode = lambda toks: tok.decode(toks, skip_special_tokens=True)  # type: ignore[attr-defined]
    return ids


def step_until_idle(engine: Engine, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.sched.is_idle():
        assert time.monotonic() < deadline, "the scheduler never went idle"
        if engine.sched.step() is None:
            time.sleep(0.001)  # a grammar is compiling: nothing to run yet


def run_all(engine: Engine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Any]:
    for rid, prompt, sp in reqs:
        engine.sched.process_input_requests([TokenizedGenerateReq(rid=rid, input_ids=prompt,
                                                                  sampling_params=sp)])
        engine.reqs[rid] = engine.sched.queue.by_rid[rid]
    step_until_idle(engine)
    engine.assert_no_leak()
    return {rid: engine.reqs[rid] for rid, _, _ in reqs}


def test_random_json_schemas_always_give_valid_json_in_a_busy_batch_with_retraction(default_model_dir, chat):
    rng = random.Random(14)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    reqs = []
    for i, schema in enumerate(schemas):
        prompt = chat(f"Reply with a JSON object with the fields {', '.join(schema['properties'])}.")
        grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        reqs.append((f"greedy-{i}", prompt, SamplingParams(max_new_tokens=256, temperature=0.0, grammar=grammar)))
        reqs.append((f"sampled-{i}", prompt, SamplingParams(max_new_tokens=256, temperature=1.0, seed=i,
                                                            grammar=grammar)))
    # 24 rows of ~45-token prompts (~30 tokens of them shared) in the small
    # pool, admitted as if answers were short: they start, outgrow the
    # pool, and rows are retracted and recomputed
    engine = Engine(default_model_dir, ignore_eos=False, dtype=DTYPE, max_running_requests=2 * SCHEMAS,
                    max_total_tokens=POOL, schedule_conservativeness=0.01)
    out = run_all(engine, reqs)
    assert engine.sched.decode.total_retractions > 0
    for rid, _, sp in reqs:
        req = out[rid]
        text = chat.decode(req.output_ids)
        assert finish_json(req.finish)["type"] == "stop", (rid, finish_json(req.finish), text)
        doc = json.loads(text)
        jsonschema.validate(doc, json.loads(sp.grammar.text))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_regex_and_ebnf_outputs_match_in_full_and_overlap_changes_nothing(default_model_dir, chat, overlap):
    cases = [
        ("phone", "Give me a phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
        ("date", "When did the war end?", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
        ("yesno", "Is the sky blue?", r"(Yes|No), because [a-z ]{5,40}\."),
        ("email", "Write an email address.", r"[a-z]{3,10}@[a-z]{3,10}\.(com|org)"),
    ]
    ebnf = 'root ::= "The answer is " animal "."\nanimal ::= "cat" | "dog" | "fish"'
    reqs = []
    for name, question, pattern in cases:
        for t in (0.0, 0.8):
            reqs.append((f"{name}-{t}", chat(question), SamplingParams(
                max_new_tokens=64, temperature=t, seed=7, grammar=Grammar(GrammarKind.REGEX, pattern))))
    reqs.append(("ebnf", chat("Name a pet."), SamplingParams(max_new_tokens=32, temperature=0.0,
                                                             grammar=Grammar(GrammarKind.EBNF, ebnf))))
    reqs.append(("free", chat("Name a pet."), SamplingParams(max_new_tokens=12, temperature=0.0)))
    # --deterministic: a row's bits do not depend on its batch mates, so the two
    # loops (whose batches differ by the rows that end a step late under
    # overlap) must give the same tokens, greedy and seeded sampling alike
    engine = Engine(default_model_dir, ignore_eos=False, dtype=DTYPE, max_running_requests=6,
                    disable_overlap_schedule=not overlap, deterministic=True)
    out = run_all(engine, reqs)
    texts = {rid: chat.decode(r.output_ids) for rid, r in out.items()}
    for name, _, pattern in cases:
        for t in (0.0, 0.8):
            assert regex.fullmatch(pattern, texts[f"{name}-{t}"]), (name, t, texts[f"{name}-{t}"])
    assert regex.fullmatch(r"The answer is (cat|dog|fish)\.", texts["ebnf"]), texts["ebnf"]
    assert finish_json(out["free"].finish) == {"type": "length", "length": 12}  # unconstrained, beside them
    # the same answers with and without overlap (greedy, and seeded sampling)
    key = tuple(sorted((rid, tuple(r.output_ids)) for rid, r in out.items()))
    if _OUTPUTS.setdefault("regex", key) != key:
        pytest.fail("overlap and plain loops gave different constrained outputs")


_OUTPUTS: dict[str, Any] = {}


def test_a_request_waiting_for_its_grammar_holds_up_nobody(default_model_dir, chat, monkeypatch):
    gate = threading.Event()
    real_compile = GrammarBackend._compile

    def slow_compile(self, grammar):
        assert gate.wait(60)
        return real_compile(self, grammar)

    monkeypatch.setattr(GrammarBackend, "_compile", slow_compile)
    # the gate, not the grammar, holds the compile: no budget for it to run out of
    engine = Engine(default_model_dir, ignore_eos=True, dtype=DTYPE, max_running_requests=4,
                    grammar_compile_timeout_s=600)
    sched = engine.sched
    grammar = Grammar(GrammarKind.REGEX, r"[0-9]{4}")
    sched.process_input_requests([
        TokenizedGenerateReq(rid="constrained", input_ids=chat("A year?"),
                             sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                            grammar=grammar)),
        TokenizedGenerateReq(rid="plain", input_ids=chat("Hello"),
                             sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0))])
    constrained, plain = sched.queue.by_rid["constrained"], sched.queue.by_rid["plain"]
    for _ in range(50):
        sched.step()
        if plain.finished:
            break
    assert finish_json(plain.finish) == {"type": "length", "length": 6}  # ran to the end meanwhile
    assert constrained in sched.queue.grammar_wait and not constrained.output_ids
    assert not sched.is_idle() and scheduler_state(sched)["num_grammar_queue_reqs"] == 1
    gate.set()
    step_until_idle(engine)
    assert regex.fullmatch(r"[0-9]{4}", chat.decode(constrained.output_ids)), constrained.output_ids
    assert finish_json(constrained.finish)["type"] == "stop"  # ignore_eos: ended by the grammar
    engine.assert_no_leak()


def test_an_aborted_request_waiting_for_its_grammar_drops_its_queued_compile(default_model_dir, chat,
                                                                             monkeypatch):
    gate = threading.Event()
    compiled: list[str] = []
    real_compile = GrammarBackend._compile

    def gated_compile(self, grammar):
        compiled.append(grammar.text)
        assert gate.wait(60)
        return real_compile(self, grammar)

    monkeypatch.setattr(GrammarBackend, "_compile", gated_compile)
    engine = Engine(default_model_dir, ignore_eos=True, dtype=DTYPE, grammar_compile_threads=1,
                    grammar_compile_timeout_s=600)
    sched = engine.sched
    sent = []
    sched.send_output = sent.append
    for rid, pattern in (("first", r"[0-9]{4}"), ("gone", r"[a-z]{5}")):
        sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=chat("A year?"),
            sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0,
                                           grammar=Grammar(GrammarKind.REGEX, pattern)))])
    first, gone = sched.queue.by_rid["first"], sched.queue.by_rid["gone"]
    while first.grammar_future.started_at is None:  # the one thread holds "first"'s compile
        time.sleep(0.005)
    assert sched.queue.grammar_backend.queued == 1
    sched.process_input_requests([AbortReq(rid="gone")])  # its client left
    assert gone.finished and finish_json(gone.finish)["type"] == "abort"
    assert sched.queue.grammar_backend.queued == 0 and gone not in sched.queue.grammar_wait
    gate.set()
    step_until_idle(engine)
    assert regex.fullmatch(r"[0-9]{4}", chat.decode(first.output_ids))
    assert compiled == [r"[0-9]{4}"]  # the aborted request's grammar was never compiled
    engine.assert_no_leak()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(default_model_dir, chat):
    engine = Engine(default_model_dir, ignore_eos=True, dtype=DTYPE)
    sent = []
    engine.sched.send_output = sent.append
    reqs = [("bad", chat("x"), SamplingParams(max_new_tokens=4, grammar=Grammar(GrammarKind.REGEX, "(unclosed"))),
            ("good", chat("x"), SamplingParams(max_new_tokens=4, temperature=0.0))]
    out = run_all(engine, reqs)
    assert finish_json(out["bad"].finish)["type"] == "abort"
    assert finish_json(out["bad"].finish)["status_code"] == 400
    assert "invalid grammar" in finish_json(out["bad"].finish)["message"]
    assert finish_json(out["good"].finish) == {"type": "length", "length": 4}
