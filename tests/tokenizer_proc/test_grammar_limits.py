"""Grammar bounds at the front end: a grammar over a size bound (characters,
enum values, nesting) is a 400 naming the bound's flag on every route, and
never reaches the scheduler; the remembered parse answers hold a hash and a
short message, never the grammar's text."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.messages import Grammar, GrammarKind, TokenizedGenerateReq
from common.server_args import ServerArgs
from tests.tokenizer_proc.server_harness import Server, post
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.grammar import GrammarLimits, check_grammars, grammar_error, limit_error, verdicts
from tokenizer_proc.tokenizer import load_tokenizer

LIMITS = GrammarLimits(max_chars=2000, max_enum_values=50, max_depth=8)


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.fixture(scope="module")
def limited(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"),
                 max_grammar_chars=LIMITS.max_chars, max_grammar_enum_values=LIMITS.max_enum_values,
                 max_grammar_depth=LIMITS.max_depth)
    yield srv
    srv.stop()


@pytest.mark.parametrize("fields,flag", [
    ({"regex": "a" * 2001}, "--max-grammar-chars"),
    ({"ebnf": 'root ::= "' + "a" * 2000 + '"'}, "--max-grammar-chars"),
    ({"json_schema": json.dumps({"enum": [f"v{i}" for i in range(51)]})}, "--max-grammar-enum-values"),
    ({"json_schema": json.dumps({"type": "object", "properties": {
        f"f{i}": {"const": i} for i in range(51)}})}, "--max-grammar-enum-values"),
    ({"json_schema": json.dumps(nested_schema(4))}, "--max-grammar-depth"),
    ({"json_schema": "[" * 100_000}, "--max-grammar-chars"),
    ({"regex": "(" * 9 + "a" + ")" * 9}, "--max-grammar-depth"),
    ({"ebnf": "root ::= " + "(" * 9 + '"a"' + ")" * 9}, "--max-grammar-depth"),
], ids=["regex-chars", "ebnf-chars", "enum", "const", "schema-depth", "huge-json", "regex-depth", "ebnf-depth"])
def test_a_grammar_over_a_bound_is_a_400_naming_the_flag_and_never_reaches_the_scheduler(
        limited: Server, fields: dict[str, Any], flag: str) -> None:
    before = len(limited.fake.received)
    status, _, raw = post(limited, {"text": "hi", "sampling_params": {"max_new_tokens": 4, **fields}})
    assert status == 400 and flag in json.loads(raw)["error"]["message"], raw
    schema = fields.get("json_schema")
    if schema is not None and not schema.startswith("["):  # the OpenAI route, through response_format
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                            "schema": json.loads(schema)}}}
        status, _, raw = post(limited, body, "/v1/chat/completions")
        assert status == 400 and flag in json.loads(raw)["error"]["message"], raw
    assert not [m for m in limited.fake.received[before:] if isinstance(m, TokenizedGenerateReq)]


def test_grammars_within_the_bounds_are_served(limited: Server) -> None:
    for fields in ({"regex": "(" * 8 + "[0-9]" + ")" * 8},  # depth 8: at the bound
                   {"regex": "[((((((((((]x"},  # a class's brackets are literals
                   {"ebnf": 'root ::= "((((((((((" [a-z]'},  # so are a quoted string's
                   {"json_schema": json.dumps({"enum": [f"v{i}" for i in range(50)]})},
                   {"json_schema": json.dumps(nested_schema(3))}):
        status, _, raw = post(limited, {"text": "hi", "sampling_params": {"max_new_tokens": 4, **fields}})
        assert status == 200, (fields, raw)


def test_limit_error_is_linear_and_recursion_free_on_hostile_nesting() -> None:
    limits = GrammarLimits(max_chars=1 << 21, max_enum_values=4096, max_depth=64)
    deep_json = Grammar(GrammarKind.JSON_SCHEMA, "[" * 1_000_000 + "]" * 1_000_000)
    assert "--max-grammar-depth" in (limit_error(deep_json, limits) or "")
    deep_regex = Grammar(GrammarKind.REGEX, "(" * 1_000_000 + ")" * 1_000_000)
    assert "nests groups 1000000 deep" in (limit_error(deep_regex, limits) or "")
    escaped = Grammar(GrammarKind.REGEX, r"\(" * 100_000)  # escaped: literals, no group
    assert limit_error(escaped, limits) is None


def test_the_parse_answers_keep_no_grammar_text() -> None:
    """30 invalid 1 MB regexes: each refused with its reason, and what stays
    behind is a digest and a short message per regex, not the megabytes."""
    args = ServerArgs(model_path="unused", max_grammar_chars=2 * 2**20)
    grammar_error(Grammar(GrammarKind.REGEX, "warm"), LIMITS)  # xgrammar imported before measuring
    verdicts.clear()
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(30):
            bad = Grammar(GrammarKind.REGEX, f"{i}" + "ab" * 500_000 + "(")  # 1 MB, unclosed
            with pytest.raises(BadRequestError, match="invalid regex"):
                asyncio.run(check_grammars([bad], args))
            del bad
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(verdicts) == 30
    assert kept - base < 1_000_000, f"{(kept - base) / 1e6:.1f} MB kept after 30 invalid 1 MB regexes"
    # remembered: the same text is answered from the cache, by its hash
    again = Grammar(GrammarKind.REGEX, "0" + "ab" * 500_000 + "(")
    assert grammar_error(again, GrammarLimits.from_args(args)) is not None and len(verdicts) == 30


def test_the_parse_answers_are_bounded_in_entries() -> None:
    verdicts.clear()
    for i in range(verdicts.MAX_ENTRIES + 10):
        grammar_error(Grammar(GrammarKind.REGEX, f"x{i}"), LIMITS)
    assert len(verdicts) == verdicts.MAX_ENTRIES
