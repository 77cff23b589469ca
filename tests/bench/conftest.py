"""A tiny random model that a real server can serve: tests/conftest.py's
tiny_llama_dir plus a word-level tokenizer over its 512 ids ("w3 w17 ..."),
so text prompts, token counts and streamed text all work end to end."""

from __future__ import annotations

import json
import shutil

import pytest

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
