"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch.

Everything runs on a flat token axis `[num_tokens, hidden]`: the rows of a
batch are concatenated, so every op but attention is one per-token matmul
no matter how ragged the batch is. Attention goes through the backend, which
knows where each row starts (`AttentionMetadata`).

Laid out for speed (the building blocks are in `layers.py`): q/k/v are one
matmul and gate/up another; each RMSNorm's weight is folded into the matmul
that follows it; rotary is applied in place to q and k together; the
residual adds and the SiLU are fused into the matmuls where oneDNN can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_proc.attention import AttentionBackend, AttentionMetadata
from model_proc.batch_invariant import pad_rows, padded_rows
from model_proc.layers import Linear, apply_rope_, fold_norm_weight, rms_norm

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
    """cos/sin tables for every position, computed once; looked up once per step.

    Only half of each is kept: in the rotate-half layout both halves of the
    table are the same frequencies (see `apply_rope_`).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_pos, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim / 2]: broadcast over heads
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


# ---- layers -------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three
        # (input_layernorm's weight is folded in)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """residual + attention(h), h the normed residual."""
        n = h.shape[0]
        qkv = self.qkv_proj(h)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        # q and k heads are adjacent in each row: rotate them in one pass, in place
        apply_rope_(qkv[:, :k_end].view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q = qkv[:, :q_end].view(n, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(n, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, self.layer_id, meta)
        return self.o_proj(o.reshape(n, self.q_size), add=residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        # gate and up in one matmul, like qkv (post_attention_layernorm's weight folded in)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + mlp(h), h the normed residual."""
        gate_up = self.gate_up_proj(h)
        gate, up = gate_up[:, :self.inter], gate_up[:, self.inter:]
        # in place in the matmul's output: no new [T, intermediate] tensors
        act = F.silu(gate, inplace=True).mul_(up)
        return self.down_proj(act, add=residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer_id, backend)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # the norms have no weight here: each is folded into the next matmul
        x = self.self_attn(rms_norm(x, self.eps), x, cos, sin, meta)
        return self.mlp(rms_norm(x, self.eps), x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        # batch-invariant forward (batch_invariant.py); the backend must be one too
        self.deterministic = deterministic
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        # its own matrix even when tied: the final norm's weight is folded in,
        # and on a CPU it is packed for the matmul, which the embedding lookup can't use
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = deterministic

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, extra_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> float32 logits [B, vocab] of each row's last token,
        followed by those of the tokens at flat indices `extra_index` (prompt
        logprobs: only the positions some row asked for pay for the head)."""
        num_tokens = input_ids.shape[0]
        if self.deterministic:
            # whole row blocks: torch's thread split of a per-token op then
            # falls between tokens, never inside one (batch_invariant.py)
            rows = padded_rows(num_tokens)
            input_ids, positions = pad_rows(input_ids, rows), pad_rows(positions, rows)
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        # only the last token of each row is sampled: skip the rest of the
        # (vocab-sized) head for the prompt tokens of an extend
        last = x[:num_tokens] if meta.is_decode else x[meta.qo_indptr[1:] - 1]
        if extra_index is not None and extra_index.numel():
            last = torch.cat([last, x[extra_index]])
        return self.lm_head(rms_norm(last, self.cfg.rms_norm_eps)).float()

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict in (fusing q/k/v and gate/up, folding
        each RMSNorm weight into the next matmul), then prepare the matmuls for
        the device. Call after the model is on its device and dtype."""
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state[name]

        def put(param: nn.Parameter | None, tensor: torch.Tensor) -> None:
            assert param is not None
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch: {tuple(param.shape)} vs {tuple(tensor.shape)}")
            param.copy_(tensor)

        def cat(names: list[str]) -> torch.Tensor:
            return torch.cat([get(n) for n in names])

        put(self.embed_tokens, get("model.embed_tokens.weight"))
        head = get("model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight")
        put(self.lm_head.weight, fold_norm_weight(head, get("model.norm.weight")))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            put(attn.qkv_proj.weight, fold_norm_weight(cat([f"{n}.weight" for n in qkv]),
                                                       get(f"{p}input_layernorm.weight")))
            if attn.qkv_proj.bias is not None:
                put(attn.qkv_proj.bias, cat([f"{n}.bias" for n in qkv]))
            put(attn.o_proj.weight, get(f"{p}self_attn.o_proj.weight"))
            if attn.o_proj.bias is not None:
                put(attn.o_proj.bias, get(f"{p}self_attn.o_proj.bias"))
            gate_up = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
            put(mlp.gate_up_proj.weight, fold_norm_weight(cat([f"{n}.weight" for n in gate_up]),
                                                          get(f"{p}post_attention_layernorm.weight")))
            if mlp.gate_up_proj.bias is not None:
                put(mlp.gate_up_proj.bias, cat([f"{n}.bias" for n in gate_up]))
            put(mlp.down_proj.weight, get(f"{p}mlp.down_proj.weight"))
            if mlp.down_proj.bias is not None:
                put(mlp.down_proj.bias, get(f"{p}mlp.down_proj.bias"))
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare()
