"""Tokenizers built inside the tests, so no test needs a downloaded file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tokenizer_proc.samples import CHATML, CORPUS
from tests.tokenizer_proc.server_harness import Server
from tokenizer_proc.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def sp_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SentencePiece BPE model with byte fallback, trained on the spot."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=0.98,
        normalization_rule_name="identity", hard_vocab_limit=False, minloglevel=2)
    return folder / "tokenizer.model"


@pytest.fixture(scope="session")
def sp_folder(sp_model_file: Path) -> Path:
    """A model folder holding tokenizer.model and no tokenizer.json."""
    return sp_model_file.parent


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE (GPT-2/SmolLM style) saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module")
def server(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The HTTP app on a real port with a fake scheduler behind it, one per test module."""
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"),
                 health_generate_timeout=0.5)
    yield srv
    srv.stop()
