"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch.

Everything runs on a flat token axis `[num_tokens, hidden]`: the rows of a
batch are concatenated, so every op but attention is one per-token matmul
no matter how ragged the batch is. Attention goes through the backend, which
knows where each row starts (`AttentionMetadata`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_proc.attention import AttentionBackend, AttentionMetadata

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        heads = d["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta included); older
        # configs have a top-level `rope_theta` and an optional `rope_scaling`.
        rope = dict(d.get("rope_scaling") or {})
        rope.update(d.get("rope_parameters") or {})
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        # Qwen2 always has a q/k/v bias; Llama has one (on o_proj too) only
        # when `attention_bias` says so.
        attention_bias = bool(d.get("attention_bias", False))
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
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope_theta=float(theta),
            rope_scaling=rope,
        )


# ---- rotary embedding ----------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # float32, as transformers computes it: at long positions a float64 table
    # would drift from the reference the checkpoints are evaluated with
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_scale(inv_freq, scaling)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


def llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, and a
    smooth blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once; looked up once per step."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim], the rotate-half layout
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim]: broadcast over heads
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---- layers -------------------------------------------------------------------------


def _param(*shape: int) -> nn.Parameter:
    # weights are filled by load_weights; no point initialising them
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_proj = _param(cfg.hidden_size, self.q_size)
        self.o_bias = _param(cfg.hidden_size) if cfg.o_bias else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = F.linear(x, self.qkv_proj, self.qkv_bias).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, self.layer_id, meta)
        return F.linear(o.reshape(n, self.q_size), self.o_proj, self.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size)  # fused, like qkv
        self.gate_up_bias = _param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = _param(cfg.hidden_size) if cfg.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj, self.gate_up_bias).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj, self.down_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> float32 logits [B, vocab] of each row's last token."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        # only the last token of each row is sampled: skip the rest of the
        # (vocab-sized) head for the prompt tokens of an extend
        last = x if meta.is_decode else x[meta.qo_indptr[1:] - 1]
        return F.linear(self.norm(last), self.lm_head).float()

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict in, fusing q/k/v and gate/up."""
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state[name]

        def put(param: nn.Parameter | None, tensor: torch.Tensor) -> None:
            assert param is not None
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch: {tuple(param.shape)} vs {tuple(tensor.shape)}")
            param.copy_(tensor)

        put(self.embed_tokens, get("model.embed_tokens.weight"))
        if not self.cfg.tie_word_embeddings:
            put(self.lm_head, get("lm_head.weight"))
        put(self.norm.weight, get("model.norm.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = ("q_proj", "k_proj", "v_proj")
            put(attn.qkv_proj, torch.cat([get(f"{p}self_attn.{n}.weight") for n in qkv]))
            if attn.qkv_bias is not None:
                put(attn.qkv_bias, torch.cat([get(f"{p}self_attn.{n}.bias") for n in qkv]))
            put(attn.o_proj, get(f"{p}self_attn.o_proj.weight"))
            if attn.o_bias is not None:
                put(attn.o_bias, get(f"{p}self_attn.o_proj.bias"))
            put(mlp.gate_up_proj, torch.cat([get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")]))
            if mlp.gate_up_bias is not None:
                put(mlp.gate_up_bias, torch.cat([get(f"{p}mlp.gate_proj.bias"), get(f"{p}mlp.up_proj.bias")]))
            put(mlp.down_proj, get(f"{p}mlp.down_proj.weight"))
            if mlp.down_bias is not None:
                put(mlp.down_bias, get(f"{p}mlp.down_proj.bias"))
            put(layer.input_layernorm.weight, get(f"{p}input_layernorm.weight"))
            put(layer.post_attention_layernorm.weight, get(f"{p}post_attention_layernorm.weight"))
