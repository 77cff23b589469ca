"""config.json of a supported model, read into `ModelConfig`, and the rule
for everything else: a config asking for something the model does not do
(another architecture, experts, a vision tower, a partial rotary, another
activation) stops the start with one line naming it, rather than serving
wrong answers.

Supported families: Llama (2/3, SmolLM2), Mistral (a sliding window on every
layer), Qwen2, Qwen3 (per-head q/k RMSNorm), Phi-3 (fused q/k/v and gate/up
tensors in the checkpoint; longrope scaling), Gemma 2 and Gemma 3 (GELU-tanh
MLP, RMSNorm by 1 + w, norms before and after attention and MLP, scaled
embeddings, `query_pre_attn_scalar`; Gemma 2's soft-capped attention and
logits; Gemma 3's q/k norms and sliding layers with their own rope).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")


class Activation(Enum):
    """The MLP's gate activation: act(gate) * up."""
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"  # Gemma


ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH,
               "gelu_tanh": Activation.GELU_TANH}


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
    # per layer, the attention window (None: full attention): a query at
    # position i sees keys i - window < j <= i, as transformers' mask
    layer_windows: tuple[int | None, ...] = ()
    # the sliding layers' own rope (Gemma 3's local theta); None: the same as the others
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    activation: Activation = Activation.SILU
    attn_scale: float = 0.0  # softmax(q.k * attn_scale): head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    # Gemma: RMSNorm scales by (1 + weight); norms after attention and after the
    # MLP too (`pre_feedforward_layernorm` is then the MLP's input norm);
    # embeddings scaled by sqrt(hidden); Gemma 2: scores and logits soft-capped
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        refuse_unsupported(d, model_type)
        gemma = model_type in GEMMA_TYPES
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        max_pos = d.get("max_position_embeddings", 2048)
        theta, rope = read_rope(d, model_type, "full_attention", max_pos)
        local_theta, local_rope = read_rope(d, model_type, "sliding_attention", max_pos) \
            if model_type == "gemma3_text" else (None, None)
        # Qwen2 always has a q/k/v bias; Llama and Qwen3 have one (on o_proj
        # too) only when `attention_bias` says so; Phi-3 none.
        attention_bias = bool(d.get("attention_bias", False)) and model_type != "phi3"
        scalar = d.get("query_pre_attn_scalar") if gemma else None
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) and model_type not in ("phi3", *GEMMA_TYPES),
            rope_theta=theta,
            rope_scaling=rope,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            fused_checkpoint=model_type == "phi3",
            layer_windows=layer_windows(d, model_type),
            local_rope_theta=local_theta,
            local_rope_scaling=local_rope,
            activation=ACTIVATIONS[hidden_activation(d)],
            attn_scale=(scalar or head_dim) ** -0.5,
            norm_weight_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=d["hidden_size"] ** 0.5 if gemma else None,
            attn_softcap=d.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_softcap=d.get("final_logit_softcapping") if gemma else None,
        )

    @property
    def sliding(self) -> bool:
        """Whether any layer attends through a window."""
        return any(w is not None for w in self.layer_windows)


def hidden_activation(d: dict[str, Any]) -> str:
    # Gemma's configs name it `hidden_activation`; the others `hidden_act`
    return d.get("hidden_activation") or d.get("hidden_act") or "silu"


def read_rope(d: dict[str, Any], model_type: str, layer_type: str, max_pos: int) -> tuple[float, dict[str, Any]]:
    """(theta, rope_type plus its parameters) of the layers of `layer_type`.

    transformers 5 writes `rope_parameters` (theta included; Gemma 3 one per
    layer type); older configs a top-level `rope_theta` and an optional
    `rope_scaling` (Gemma 3's local layers: `rope_local_base_freq`, unscaled)."""
    params = d.get("rope_parameters") or {}
    if layer_type in params or "full_attention" in params:
        params = params.get(layer_type) or {}
        legacy = {} if layer_type == "sliding_attention" else dict(d.get("rope_scaling") or {})
    else:
        legacy = dict(d.get("rope_scaling") or {})
        if layer_type == "sliding_attention":  # an older Gemma 3 config: default rope, its own theta
            legacy, params = {}, {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    rope = {**legacy, **params}
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    default_theta = 1e6 if model_type == "gemma3_text" else 10000.0
    theta = rope.pop("rope_theta", None) or d.get("rope_theta") or default_theta
    rope.pop("partial_rotary_factor", None)  # checked to be 1.0 by refuse_unsupported
    if model_type == "phi3" and rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"  # early Phi-3 names for it (transformers renames them too)
    if rope["rope_type"] == "longrope":
        resolve_longrope(rope, d, max_pos)
    return float(theta), rope


def refuse_unsupported(d: dict[str, Any], model_type: str) -> None:
    """One ValueError line for a config a supported model_type may still carry
    but the model does not run."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if (d.get(key) or 0) > 0:
            raise ValueError(f"mixture-of-experts models are not supported ({key}={d[key]})")
    if d.get("vision_config") is not None:
        raise ValueError("multimodal models (a vision_config) are not supported")
    act = hidden_activation(d)
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if d.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (an embedding model) is not supported")
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{model_type}: partial_rotary_factor {partial} is not supported (only 1.0: "
                         "rotary over the whole head)")


def layer_windows(d: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers' model of this type
    applies it (None: full attention). `layer_types` where the config has
    them (Gemma 2/3 always; Qwen2/Qwen3 with `use_sliding_window`); else
    Mistral and Phi-3 slide on every layer whenever `sliding_window` is set,
    Qwen2/Qwen3 (with `use_sliding_window`) from `max_window_layers` on, Gemma
    2 on every other layer from the first, Gemma 3 on five layers of six."""
    n = d["num_hidden_layers"]
    w = d.get("sliding_window")
    full: tuple[int | None, ...] = (None,) * n
    if w is None or model_type == "llama":
        return full
    w = int(w)
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return full
    types = d.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer type {sorted(unknown)[0]!r} is not supported "
                             "(sliding_attention, full_attention)")
        return tuple(w if t == "sliding_attention" else None for t in types)
    if model_type in ("mistral", "phi3"):
        return (w,) * n
    if model_type in ("qwen2", "qwen3"):
        first = d.get("max_window_layers", 28)
        return tuple(w if i >= first else None for i in range(n))
    pattern = 2 if model_type == "gemma2" else d.get("sliding_window_pattern", 6)
    return tuple(w if (i + 1) % pattern else None for i in range(n))


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
