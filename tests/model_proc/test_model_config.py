"""Reading config.json of the supported Llama-family variants."""

from __future__ import annotations

import math

import pytest
import torch

from model_proc.model import ModelConfig, rope_inv_freq
from model_proc.model_config import Activation

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
    with pytest.raises(ValueError, match="qwen3_moe"):
        ModelConfig.from_dict({**BASE, "model_type": "qwen3_moe"})
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 1e4, {"rope_type": "yarn"})


def test_qwen3_and_phi3_fields():
    qwen3 = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not (qwen3.qkv_bias or qwen3.o_bias)
    biased = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert biased.qkv_bias and biased.o_bias
    phi3 = ModelConfig.from_dict({**BASE, "model_type": "phi3", "attention_bias": True, "rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 1.0}})
    assert phi3.fused_checkpoint and not (phi3.qk_norm or phi3.qkv_bias or phi3.o_bias)


def test_longrope_parameters_resolved_as_transformers():
    factors = [1.0] * 8
    cfg = ModelConfig.from_dict({**BASE, "model_type": "phi3", "max_position_embeddings": 131072,
                                 "original_max_position_embeddings": 4096, "rope_scaling": {
                                     "type": "su", "short_factor": factors, "long_factor": factors}})
    s = cfg.rope_scaling
    assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == 4096
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    with pytest.raises(ValueError, match="factors for a head of 16"):
        rope_inv_freq(16, 1e4, {"rope_type": "longrope", "short_factor": [1.0] * 4})


# a sliding window that Qwen2/Qwen3 configs carry switched off
QWEN_WINDOW_OFF = {"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 0}


@pytest.mark.parametrize("fields, reason", [
    ({"model_type": "qwen2", "num_experts": 8}, "mixture-of-experts"),
    ({"num_local_experts": 4}, "mixture-of-experts"),
    ({"model_type": "qwen2", "vision_config": {"depth": 2}}, "vision_config"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
], ids=["moe", "mixtral_experts", "vision", "phi3_partial_rotary", "phi3_partial_rotary_in_rope",
        "activation", "longrope_without_long_factor"])
def test_configs_the_model_does_not_run_are_refused_in_one_line(fields, reason):
    with pytest.raises(ValueError, match=reason) as e:
        ModelConfig.from_dict({**BASE, **fields})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields, windows", [
    ({"model_type": "qwen2", **QWEN_WINDOW_OFF}, (None, None)),
    ({"model_type": "qwen3", **QWEN_WINDOW_OFF}, (None, None)),
    ({"model_type": "qwen3", **QWEN_WINDOW_OFF, "use_sliding_window": True, "max_window_layers": 2}, (None, None)),
    ({"model_type": "qwen3", **QWEN_WINDOW_OFF, "use_sliding_window": True, "max_window_layers": 1},
     (None, 32768)),
    ({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, (None, 512)),
    ({"model_type": "mistral", "sliding_window": 4096}, (4096, 4096)),
    ({"model_type": "mistral", "sliding_window": None}, (None, None)),
    ({"model_type": "phi3", "sliding_window": 2047}, (2047, 2047)),
    ({"model_type": "llama", "sliding_window": 100}, (None, None)),
    ({"model_type": "gemma2", "sliding_window": 4096}, (4096, None)),
    ({"model_type": "gemma3_text", "sliding_window": 512, "num_hidden_layers": 7}, (512,) * 5 + (None, 512)),
    ({"model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 2}, (512, None)),
], ids=["qwen2_off", "qwen3_off", "qwen3_on_no_layer", "qwen3_on_from_layer_1", "qwen2_layer_types",
        "mistral_v01", "mistral_none", "phi3_mini_4k", "llama_ignores", "gemma2_alternating",
        "gemma3_five_of_six", "gemma3_pattern"])
def test_each_layer_gets_the_window_transformers_applies(fields, windows):
    cfg = ModelConfig.from_dict({**BASE, **fields})
    assert cfg.layer_windows == windows
    assert cfg.sliding == any(w is not None for w in windows)


def test_gemma_fields():
    g2 = ModelConfig.from_dict({**BASE, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
                                "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0, "sliding_window": 8})
    assert g2.attn_scale == 256 ** -0.5 and g2.attn_softcap == 50.0 and g2.final_softcap == 30.0
    assert g2.activation is Activation.GELU_TANH and g2.sandwich_norms and g2.norm_weight_offset == 1.0
    assert g2.embed_scale == 8.0 and g2.tie_word_embeddings and not g2.qk_norm and g2.local_rope_theta is None
    # transformers 5's per-layer-type rope parameters, and the older top-level fields
    g3 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 8, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert g3.qk_norm and g3.attn_softcap is None and g3.attn_scale == 16 ** -0.5
    assert (g3.rope_theta, g3.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (g3.local_rope_theta, g3.local_rope_scaling) == (1e4, {"rope_type": "default"})
    old = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 8, "rope_theta": 1e6,
                                 "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (old.rope_theta, old.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (old.local_rope_theta, old.local_rope_scaling) == (1e4, {"rope_type": "default"})
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="layer type 'chunked_attention'"):
        ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 8,
                               "layer_types": ["chunked_attention", "full_attention"]})
