"""Where the weights come from: a Hugging Face folder, or a GGUF file converted
once (through transformers' GGUF loader) into a cached Hugging Face folder."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import contextlib
import functools
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

logger = logging.getLogger(__name__)


def is_hf_folder(path: str) -> bool:
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(n.endswith(".safetensors") for n in os.listdir(path)))


# part of the cache key: raised when convert_gguf writes something new (2: end-of-turn
# eos ids), so that no folder an older converter wrote is reused
CONVERTER_VERSION = 2


def gguf_cache_folder(gguf_path: str, cache_dir: str) -> str:
    """`cache_dir/<stem>-<hash>`: the hash covers path, size, mtime and
    CONVERTER_VERSION, so a replaced file (or a changed converter) gets a fresh
    conversion instead of a stale cache hit."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir, f"{stem}-{key}")


def resolve_model_path(model_path: str, cache_dir: str) -> str:
    """A Hugging Face folder the model can be loaded from (converting a GGUF once)."""
    if is_hf_folder(model_path):
        return model_path
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        target = gguf_cache_folder(model_path, cache_dir)
        if not is_hf_folder(target):
            # tensor-parallel ranks start together: one converts, the others
            # wait for it and find the folder, instead of each converting
            # (removing the lock file is safe: a waiter that locked the old
            # file, or one that makes a new one, checks the folder again;
            # convert_gguf itself survives two converters)
            os.makedirs(cache_dir, exist_ok=True)
            lock_path = target + ".lock"
            with open(lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    if not is_hf_folder(target):
                        convert_gguf(model_path, target)
                finally:
                    try:
                        os.unlink(lock_path)
                    except OSError:
                        pass
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
        with gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # The weights are dequantized already; a leftover quantization config
        # would make a later from_pretrained look for GGUF kernels.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        _add_end_of_turn_eos(model.generation_config, tokenizer.get_vocab())
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


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While it lasts, gguf-py's `GGUFReader(path)` gives one reader per file
    and `get_tensor_name_map(arch, layers)` one map per pair. transformers'
    GGUF loading parses the file's metadata three times (config, weights,
    tokenizer), each a few seconds for a vocabulary of ~50k strings and more
    for Gemma's 262k, and builds gguf-py's tensor-name map once per module
    (~400 times, ~25 ms each): the default model's conversion took ~30 s on
    2 cores, most of it those. transformers only reads either."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


# Tokens that end a generation besides the GGUF's eos: llama.cpp stops at them too (its
# end-of-generation set), but transformers' GGUF loader keeps tokenizer.ggml.eos_token_id
# alone. Gemma's own generation_config lists <end_of_turn> (106) beside <eos> (1): without
# it, a chat answer would run on past its turn.
END_OF_TURN_TOKENS = ("<end_of_turn>",)


def _add_end_of_turn_eos(generation_config: Any, vocab: dict[str, int]) -> None:
    eos = generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    extra = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    if extra:
        generation_config.eos_token_id = ids + extra


def safetensors_files(folder: str) -> list[str]:
    """model.safetensors, or every shard its index names."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"no model.safetensors or index in {folder}")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(folder, s) for s in shards]


class CheckpointReader:
    """Reads a safetensors checkpoint tensor by tensor, and a tensor only in
    the rows or columns asked for: a tensor-parallel rank reads its shard and
    nothing else, and no whole state dict is ever in memory (the files are
    memory-mapped; a slice copies out only its own bytes)."""

    def __init__(self, folder: str) -> None:
        self._stack = ExitStack()
        self._file_of: dict[str, object] = {}
        for path in safetensors_files(folder):
            f = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for name in f.keys():
                self._file_of[name] = f

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def numel(self) -> int:
        """Elements of every tensor in the checkpoint (nothing is read)."""
        total = 0
        for name in self._file_of:
            n = 1
            for d in self.shape(name):
                n *= d
            total += n
        return total

    def read(self, name: str, dim: int = 0, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """The tensor, or its [start, end) along `dim` (0 or 1)."""
        sl = self._slice(name)
        if start is None and end is None:
            return sl[:]
        if dim == 0:
            return sl[start:end]
        if dim == 1:
            return sl[:, start:end]
        raise ValueError(f"dim {dim}: only rows (0) or columns (1) are sharded")

    def _slice(self, name: str):  # safetensors' lazy slice of one tensor
        f = self._file_of.get(name)
        if f is None:
            # a ValueError: the model process reports it as "cannot start", one line
            raise ValueError(f"weight {name!r} missing from the checkpoint")
        return f.get_slice(name)


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard its index names, in
    memory at once (tests and tools; the server loads through CheckpointReader)."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        state.update(load_file(path))
    return state
