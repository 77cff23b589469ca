from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.tokenizer_proc.samples import TEXT
from tokenizer_proc.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer


def test_picks_sentencepiece_for_model_file_or_folder(sp_model_file: Path, sp_folder: Path) -> None:
    assert isinstance(load_tokenizer(str(sp_model_file)), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(str(sp_folder)), SentencePieceTokenizer)


def test_picks_hf_when_tokenizer_json_present(hf_folder: Path, sp_model_file: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(str(hf_folder)), HFTokenizer)
    # tokenizer.json wins over a tokenizer.model lying beside it.
    both = tmp_path / "both"
    shutil.copytree(hf_folder, both)
    shutil.copy(sp_model_file, both / "tokenizer.model")
    assert isinstance(load_tokenizer(str(both)), HFTokenizer)


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))


def test_a_folder_without_tokenizer_files_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*tokenizer.json.*tokenizer.model"):
        load_tokenizer(str(tmp_path))


def test_sentencepiece_interface(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    assert isinstance(tok, SentencePieceTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id == 1  # BOS prepended, as Llama expects
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert tok.eos_token_ids == [2]
    assert tok.vocab_size == tok.sp.get_piece_size()
    chat = tok.apply_chat_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ])
    assert chat.count(1) == 2 and chat.count(2) == 1  # two turns, one finished
    rendered = tok.decode(chat, skip_special_tokens=False)
    assert rendered.startswith("<s> [INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST]")
    assert rendered.endswith(" hello</s><s> [INST] bye [/INST]")  # trailing space normalized away
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_hf_interface(hf_folder: Path) -> None:
    tok = load_tokenizer(str(hf_folder))
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_ids == [2]
    assert tok.vocab_size == 300
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(chat, list) and all(isinstance(i, int) for i in chat)
    assert tok.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_real_smollm2_tokenizer(default_model_dir: str) -> None:
    tok = load_tokenizer(default_model_dir)
    assert tok.eos_token_ids[0] == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
