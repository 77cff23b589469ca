"""common/tokenizer_files.py: the direct load of a generic tokenizer gives
what AutoTokenizer gives."""

from __future__ import annotations

import json
import os
import shutil

from common.tokenizer_files import load_hf_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café 東京 🤖", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_a_generic_tokenizer_loads_directly_and_equals_auto_tokenizer(default_model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    config = json.load(open(os.path.join(default_model_dir, "tokenizer_config.json")))
    assert config["tokenizer_class"] == "TokenizersBackend"  # the default model's: it takes the direct path
    ours = load_hf_tokenizer(default_model_dir)
    auto = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.decode(ours(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, len(ours)) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, len(auto))


def test_a_named_class_goes_through_auto_tokenizer(default_model_dir, tmp_path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(default_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.load(open(folder / "tokenizer_config.json"))
    config["tokenizer_class"] = "GPT2Tokenizer"  # what AutoTokenizer maps to its own class
    json.dump(config, open(folder / "tokenizer_config.json", "w"))
    assert type(load_hf_tokenizer(str(folder))).__name__ != "TokenizersBackend"
