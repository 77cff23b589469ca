"""config.json of a supported model, read into `ModelConfig`, and the rule
for everything else: a config asking for something the model does not do
(another architecture, experts, a vision tower, a sliding window, a partial
rotary, another activation) stops the start with one line naming it, rather
than serving wrong answers.

Supported families: Llama (2/3, SmolLM2), Mistral, Qwen2, Qwen3 (per-head
q/k RMSNorm) and Phi-3 (fused q/k/v and gate/up tensors in the checkpoint;
longrope scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any]  # rope_type plus its parameters; {"rope_type": "default"} if none
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    # Phi-3: the checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    fused_checkpoint: bool = False
    # the attention window transformers applies (None: full attention); run
    # only with a context it cannot cut (`check_context`)
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        refuse_unsupported(d, model_type)
        heads = d["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta included); older
        # configs have a top-level `rope_theta` and an optional `rope_scaling`.
        rope = dict(d.get("rope_scaling") or {})
        rope.update(d.get("rope_parameters") or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        rope.pop("partial_rotary_factor", None)  # checked to be 1.0 by refuse_unsupported
        max_pos = d.get("max_position_embeddings", 2048)
        if model_type == "phi3" and rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"  # early Phi-3 names for it (transformers renames them too)
        if rope["rope_type"] == "longrope":
            resolve_longrope(rope, d, max_pos)
        # Qwen2 always has a q/k/v bias; Llama and Qwen3 have one (on o_proj
        # too) only when `attention_bias` says so; Phi-3 none.
        attention_bias = bool(d.get("attention_bias", False)) and model_type != "phi3"
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) and model_type != "phi3",
            rope_theta=float(theta),
            rope_scaling=rope,
            qk_norm=model_type == "qwen3",
            fused_checkpoint=model_type == "phi3",
            sliding_window=effective_sliding_window(d, model_type),
        )

    def check_context(self, context_len: int) -> None:
        """Refuse a context the model's sliding window would cut: within the
        window, full attention is what transformers computes too."""
        w = self.sliding_window
        if w is not None and context_len > w:
            raise ValueError(f"the model's sliding-window attention ({w} tokens) is not supported; "
                             f"a context of {w} tokens or less runs it exactly (--context-length {w})")


def refuse_unsupported(d: dict[str, Any], model_type: str) -> None:
    """One ValueError line for a config a supported model_type may still carry
    but the model does not run."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if (d.get(key) or 0) > 0:
            raise ValueError(f"mixture-of-experts models are not supported ({key}={d[key]})")
    if d.get("vision_config") is not None:
        raise ValueError("multimodal models (a vision_config) are not supported")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (silu)")
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{model_type}: partial_rotary_factor {partial} is not supported (only 1.0: "
                         "rotary over the whole head)")


def effective_sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window transformers' model of this type applies, None when it
    attends fully: Mistral and Phi-3 use `sliding_window` whenever it is set;
    Qwen2/Qwen3 only with `use_sliding_window` and a layer it applies to
    (`layer_types`, or the layers from `max_window_layers` on)."""
    w = d.get("sliding_window")
    if w is None or model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types")
        if layer_types is not None:
            slides = any(t == "sliding_attention" for t in layer_types)
        else:
            slides = d.get("max_window_layers", 28) < d["num_hidden_layers"]
        if not slides:
            return None
    return int(w)


def resolve_longrope(rope: dict[str, Any], d: dict[str, Any], max_pos: int) -> None:
    """Fill in longrope's derived parameters as transformers does: the
    pretraining length (Phi-3's top-level `original_max_position_embeddings`
    first), and the attention factor that scales cos/sin, from the context
    extension factor when the config gives none."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(rope.get(key), list):
            raise ValueError(f"longrope needs a {key} list")
    orig = d.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_pos
    rope["original_max_position_embeddings"] = int(orig)
    factor = rope.get("factor") or max_pos / orig
    if rope.get("attention_factor") is None:
        rope["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
