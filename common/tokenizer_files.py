"""Where a model's tokenizer is and which format it has, and loading the
Hugging Face one: what the tokenizer process (tokenizer_proc/tokenizer.py)
and the scheduler's grammar compiler (scheduler_proc/grammar.py) both need,
kept here so that neither process imports the other."""

from __future__ import annotations

import json
import os
from typing import Any, Literal

# any of these makes a folder one that transformers' AutoTokenizer can load
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

TokenizerFormat = Literal["hf", "sentencepiece"]

# tokenizer_config.json's `tokenizer_class` names of transformers' generic
# tokenizers.json tokenizer, the one AutoTokenizer would build for them
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def find_tokenizer(path: str) -> tuple[TokenizerFormat, str]:
    """("hf", the folder) for a folder with tokenizer.json (or another file
    AutoTokenizer reads); ("sentencepiece", the .model file) for a folder with
    only tokenizer.model, or a .model file itself."""
    if os.path.isfile(path):
        if path.endswith(".model"):
            return "sentencepiece", path
        raise ValueError(f"not a tokenizer file (expected a .model file): {path}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    sp_file = os.path.join(path, "tokenizer.model")
    if not os.path.exists(os.path.join(path, "tokenizer.json")) and os.path.exists(sp_file):
        return "sentencepiece", sp_file
    if not any(os.path.exists(os.path.join(path, f)) for f in HF_TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {path}: expected tokenizer.json (Hugging Face) or "
                                "tokenizer.model (SentencePiece)")
    return "hf", path


def import_tokenizer_library() -> None:
    """Import transformers' tokenizer base class (~1.3 s on 2 cores), which every
    kind of folder loads through. The front end calls it while the model process
    loads, so a server start no longer waits for it after the model is ready."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401


def load_hf_tokenizer(folder: str) -> Any:
    """transformers' AutoTokenizer of a folder, local files only. Where the
    folder names the generic tokenizer (as the default model's converted GGUF
    does), that class is loaded directly: the same tokenizer, without
    AutoTokenizer's model-config machinery and torch, 0.9 s instead of 3.8 s,
    which every server start waits for."""
    if _configured_class(folder) in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer  # slow import: only when needed

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _configured_class(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None
