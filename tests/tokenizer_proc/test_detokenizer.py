from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokenizer_proc.samples import TEXT
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.tokenizer import Tokenizer, load_tokenizer


def stream(tok: Tokenizer, ids: list[int], chunk: int, skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


def check_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for chunk in (1, 2, 3, 5, len(ids)):
        pieces = stream(tok, ids, chunk)
        assert "".join(pieces) == tok.decode(ids) == text, chunk
        assert not any("\ufffd" in p for p in pieces), (chunk, pieces)


@pytest.fixture(params=["sentencepiece", "hf"])
def tokenizer(request: pytest.FixtureRequest, sp_model_file: Path, hf_folder: Path) -> Tokenizer:
    return load_tokenizer(str(sp_model_file if request.param == "sentencepiece" else hf_folder))


def test_round_trip_multibyte(tokenizer: Tokenizer) -> None:
    check_round_trip(tokenizer, TEXT)
    check_round_trip(tokenizer, "🦀🦀 Ж\n\nline two 東京")


def test_holds_back_split_character(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    ids = tok.encode("🦀")  # not in the training corpus: four byte tokens
    detok = IncrementalDetokenizer(tok)
    out = [detok.add([i]) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🦀"


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("ok café") + [eos] + tokenizer.encode("🙂 again")
    for skip in (True, False):
        for chunk in (1, 2):
            text = "".join(stream(tokenizer, ids, chunk, skip))
            assert text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_flush_emits_incomplete_tail(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    ids = tok.encode("🦀")[:-1]  # generation stopped mid-character
    pieces = stream(tok, ids, 1)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].endswith("\ufffd")  # only the final flush may carry one


def test_round_trip_smollm2(default_model_dir: str) -> None:
    check_round_trip(load_tokenizer(default_model_dir), TEXT + " “quotes”  two  spaces \n")
