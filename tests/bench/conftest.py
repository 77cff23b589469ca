"""A tiny random model that a real server can serve: tests/conftest.py's
tiny_llama_dir plus a word-level tokenizer over its 512 ids ("w3 w17 ..."),
so text prompts, token counts and streamed text all work end to end; and
`recorded`, a test's own place for the runs the benchmarks record."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

from bench.lib import run_record
from bench.lib.run_record import RunRecord
from tests.helpers import TINY_CONFIG


@pytest.fixture(scope="session")
def tiny_served_model(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny_served") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    specials = {"<unk>": 0, "<s>": TINY_CONFIG["bos_token_id"], "</s>": TINY_CONFIG["eos_token_id"]}
    vocab = {**specials, **{f"w{i}": i for i in range(len(specials), TINY_CONFIG["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
         "eos_token": "</s>"}))
    return str(folder)


class Recorded:
    """A test's own bench/results/latest/ and bench/RESULTS.md, where a
    benchmark run in it records its run (bench/lib/run_record.py)."""

    def __init__(self, folder: str) -> None:
        self.records_dir = os.path.join(folder, "latest")
        self.results_md = os.path.join(folder, "RESULTS.md")

    def check(self, bench: str) -> RunRecord:
        """The benchmark's record, after checking that it is today's and that
        RESULTS.md is what the records render."""
        path = run_record.record_path(bench.rsplit(".", 1)[-1], self.records_dir)
        with open(path) as f:
            record = RunRecord.from_json(json.load(f))
        assert record.bench == bench and record.date == run_record.today()
        assert record.command.startswith(f"python -m {bench}")
        with open(self.results_md) as f:
            text = f.read()
        assert text == run_record.render_results(run_record.load_all(self.records_dir))
        assert f"\n## {record.title}, {record.date}\n" in text
        return record


@pytest.fixture
def recorded(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Recorded:
    rec = Recorded(str(tmp_path / "records"))
    monkeypatch.setattr(run_record, "RECORDS_DIR", rec.records_dir)
    monkeypatch.setattr(run_record, "RESULTS_MD", rec.results_md)
    return rec
