"""Where the weights come from: a Hugging Face folder, or a GGUF file converted
once (through transformers' GGUF loader) into a cached Hugging Face folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)


def is_hf_folder(path: str) -> bool:
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(n.endswith(".safetensors") for n in os.listdir(path)))


def gguf_cache_folder(gguf_path: str, cache_dir: str) -> str:
    """`cache_dir/<stem>-<hash>`: the hash covers path, size and mtime, so a
    replaced file gets a fresh conversion instead of a stale cache hit."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir, f"{stem}-{key}")


def resolve_model_path(model_path: str, cache_dir: str) -> str:
    """A Hugging Face folder the model can be loaded from (converting a GGUF once)."""
    if is_hf_folder(model_path):
        return model_path
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        target = gguf_cache_folder(model_path, cache_dir)
        if not is_hf_folder(target):
            convert_gguf(model_path, target)
        return target
    raise FileNotFoundError(
        f"model path {model_path!r} is neither a Hugging Face folder "
        "(config.json + *.safetensors) nor a .gguf file")


def convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face folder at `target`.

    Written into a temporary sibling and renamed into place, so a crash (or a
    concurrent converter) never leaves a half-written cache that looks valid.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    logger.info("Converting %s into %s (once; later starts reuse it)", gguf_path, target)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # The weights are dequantized already; a leftover quantization config
        # would make a later from_pretrained look for GGUF kernels.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is an ordinary folder
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_hf_folder(target):  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted in %.1f s", time.perf_counter() - t0)


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard its index names."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"no model.safetensors or index in {folder}")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(os.path.join(folder, shard)))
    return state
