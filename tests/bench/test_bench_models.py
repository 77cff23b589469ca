"""bench/lib/bench_models.py: random models of each architecture, built once."""

from __future__ import annotations

import os

import pytest

from bench.lib import bench_models
from model_proc.model_config import ModelConfig

TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=512)
VOCAB = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.parametrize("family", list(bench_models.FAMILIES))
def test_each_family_is_the_default_models_shape_with_its_own_features(family):
    """(llama1b is Llama 3.2 1B's shape, with the default vocabulary.)"""
    from transformers import AutoConfig

    args = bench_models.spec(family, VOCAB)
    cfg = ModelConfig.from_dict(AutoConfig.for_model(args.pop("model_type"), **args).to_dict())
    shape = (2048, 16, 32, 8, 64, 8192) if family == "llama1b" else (576, 30, 9, 3, 64, 1536)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (*shape, 49152)
    features = {"llama1b": cfg.tie_word_embeddings and not cfg.sliding and cfg.rope_theta == 500000.0,"qwen3": cfg.qk_norm and not cfg.sliding,
                "phi3": cfg.fused_checkpoint and not cfg.tie_word_embeddings,
                "mistral": cfg.layer_windows == (128,) * 30,
                "gemma2": (cfg.layer_windows[:2] == (4096, None) and cfg.attn_softcap == 50.0
                           and cfg.final_softcap == 30.0 and cfg.sandwich_norms and cfg.attn_scale == 64 ** -0.5)}
    assert features[family]


def test_a_model_is_built_once_with_the_tokenizer_and_again_for_another_spec(default_model_dir, tmp_path):
    folder = bench_models.ensure("qwen3", str(tmp_path), default_model_dir, TINY_SHAPE)
    assert folder == str(tmp_path / "qwen3")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    built = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    assert bench_models.ensure("qwen3", str(tmp_path), default_model_dir, TINY_SHAPE) == folder
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == built
    bench_models.ensure("qwen3", str(tmp_path), default_model_dir, {**TINY_SHAPE, "num_hidden_layers": 1})
    assert bench_models.built_from(folder)["num_hidden_layers"] == 1
    assert sorted(os.listdir(tmp_path)) == ["qwen3"]  # no temporary folder left


def test_bench_model_names():
    assert bench_models.family_of("gemma2-like") == "gemma2"
    assert bench_models.family_of("gemma2") is None and bench_models.family_of("llama-like") is None
