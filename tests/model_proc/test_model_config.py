"""Reading config.json of the supported Llama-family variants."""

from __future__ import annotations

import pytest
import torch

from model_proc.model import ModelConfig, rope_inv_freq

BASE = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4)


def test_older_configs_with_rope_theta_and_rope_scaling():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "type": "linear", "factor": 2.0}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    torch.testing.assert_close(rope_inv_freq(16, 5e5, cfg.rope_scaling) * 2, rope_inv_freq(16, 5e5, {}))


def test_defaults_and_biases():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling == {"rope_type": "default"}
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.tie_word_embeddings)
    qwen = ModelConfig.from_dict({**BASE, "model_type": "qwen2"})
    assert qwen.qkv_bias and not qwen.o_bias
    assert ModelConfig.from_dict({**BASE, "model_type": "mistral", "head_dim": None}).head_dim == 16


def test_unsupported_architectures_and_rope_types_are_refused():
    with pytest.raises(ValueError, match="qwen3"):
        ModelConfig.from_dict({**BASE, "model_type": "qwen3"})
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 1e4, {"rope_type": "yarn"})
