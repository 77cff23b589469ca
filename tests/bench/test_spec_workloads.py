"""The editing workload of bench/serving/spec_decode.py (bench/lib/spec_workloads.py)
is deterministic and well formed: the same requests for the same seed, each
asking for a rename whose answer its prompt almost holds already."""

from __future__ import annotations

import json
import os

from bench.lib import spec_workloads as sw


def test_the_same_seed_builds_the_same_requests_and_another_seed_others() -> None:
    assert sw.editing_workload(16, seed=1) == sw.editing_workload(16, seed=1)
    assert sw.editing_workload(16, seed=1) != sw.editing_workload(16, seed=2)


def test_a_longer_workload_begins_with_a_shorter_ones_requests() -> None:
    assert sw.editing_workload(16, seed=3)[:8] == sw.editing_workload(8, seed=3)


def test_the_workload_mixes_the_three_kinds_edits_half_of_it() -> None:
    reqs = sw.editing_workload(16, seed=1, max_tokens=100)
    assert [r.kind for r in reqs] == [sw.MIX[i % len(sw.MIX)] for i in range(16)]
    assert sum(r.kind == "edit" for r in reqs) == 8
    assert all(r.max_tokens == 100 for r in reqs)
    for r in reqs:
        assert r.messages == [{"role": "user", "content": r.prompt}]


def test_an_edit_names_both_names_and_its_reference_is_the_file_with_the_rename_only() -> None:
    edits = sw.edit_requests(12, seed=1, max_tokens=256)
    assert len({r.source for r in edits}) == len(edits)  # as many files as there are, before one comes again
    for r in edits:
        with open(os.path.join(sw.ROOT, r.source)) as f:
            source = f.read()
        assert sw.MIN_LINES <= source.count("\n") <= sw.MAX_LINES
        assert source in r.prompt and r.source in r.prompt
        old, new = r.prompt.split("`")[1], r.prompt.split("`")[3]
        assert f"rename `{old}` to `{new}`" in r.prompt
        assert old in sw.rename_candidates(source) and not sw._word(new).search(source)
        assert r.reference is not None and r.reference.startswith("```python\n") and r.reference.endswith("```")
        body = r.reference[len("```python\n"):-3]
        assert not sw._word(old).search(body) and sw._word(new).search(body)
        assert sw._word(new).sub(old, body) == source  # nothing but the rename


def test_rename_candidates_are_whole_names_never_attributes_builtins_or_self() -> None:
    source = ("import os\n\nclass Thing:\n    def method(self, count):\n        total = count + 1\n"
              "        self.total = total\n        return count * len(os.sep)\n\n\ndef method2(count):\n"
              "    return count\n")
    names = sw.rename_candidates(source)
    assert "count" in names          # an argument, used as a word only
    assert "total" not in names      # also an attribute: `self.total` is another object's name
    assert "self" not in names and "len" not in names and "Thing" not in names  # Thing occurs once


def test_a_quote_request_holds_one_prose_paragraph_of_the_docs() -> None:
    quotes = sw.quote_requests(6, seed=1, max_tokens=192)
    assert len({r.source for r in quotes}) == 6
    for r in quotes:
        doc = r.source.split(" paragraph ")[0]
        assert doc in sw.DOCS
        paragraph = r.prompt.split("Paragraph:\n", 1)[1]
        assert paragraph in sw.paragraphs(open(os.path.join(sw.ROOT, doc)).read())
        assert sw.MIN_PARAGRAPH <= len(paragraph) <= sw.MAX_PARAGRAPH and "\n" not in paragraph


def test_paragraphs_skip_code_headings_tables_and_lists() -> None:
    prose = "This is a sentence of prose that runs on. " * 10
    text = "\n".join(["# Heading " + prose, "", "```", prose, "```", "", "| a | b |", "", "- " + prose, "",
                      prose, ""])
    assert sw.paragraphs(text) == [prose.strip()]


def test_a_json_request_renames_one_key_of_server_args_defaults_and_keeps_the_rest() -> None:
    from common.server_args import ServerArgs

    facts = sw.server_arg_defaults()
    assert facts["port"] == ServerArgs().port and "model_path" in facts
    for r in sw.json_requests(8, seed=1, max_tokens=256):
        obj = json.loads(r.prompt.split("\n\n", 1)[1])
        old, new = r.prompt.split('"')[1], r.prompt.split('"')[3]
        assert sw.JSON_KEYS[0] <= len(obj) <= sw.JSON_KEYS[1]
        assert all(facts[k] == v for k, v in obj.items()) and old in obj and new not in obj
        assert r.reference is not None
        renamed = json.loads(r.reference)
        assert list(renamed) == [new if k == old else k for k in obj]
        assert list(renamed.values()) == list(obj.values())
