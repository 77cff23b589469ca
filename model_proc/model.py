"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) in plain torch.

Everything runs on a flat token axis `[num_tokens, hidden]`: the rows of a
batch are concatenated, so every op but attention is one per-token matmul
no matter how ragged the batch is. Attention goes through the backend, which
knows where each row starts (`AttentionMetadata`).

Laid out for speed (the building blocks are in `layers.py`): q/k/v are one
matmul and gate/up another; each RMSNorm's weight is folded into the matmul
that follows it, and the norm itself runs inside that matmul's call where the
kernel can; rotary is applied in place to q and k together; the residual
adds and SiLU(gate) * up are fused into the matmuls where the kernel can
(layers.py). A step whose every piece is native (bfloat16 on a CPU with the
native attention backend, one rank) runs its decoder layers as one native
call (model_proc/native_decoder.py): the same ops, without Python between
them; this module knows no particular attention backend.

The families differ in a few config fields (model_config.py, which also
refuses what none of them runs): Qwen2's q/k/v bias; Qwen3's RMSNorm over
each q and k head before rotary (`Attention.qk_norm`); Phi-3's checkpoint
tensors holding q/k/v and gate/up already stacked (split by rank at load)
and its longrope scaling (`RotaryEmbedding`); Mistral's sliding window (the
attention backend's per-layer `LayerAttention`). Gemma 2/3 differ most:
RMSNorm by (1 + w) (the offset added at load, so the folding is the same),
a second norm after attention and after the MLP, applied before each
residual add (`DecoderLayer.post_norms`), GELU-tanh in the MLP, embeddings
scaled by sqrt(hidden), Gemma 2's soft-capped logits (and scores, in the
backend), Gemma 3's sliding layers with a rope of their own (`local_rotary`).

Tensor parallelism (`--tp-size`, model_proc/parallel.py): each rank builds
this model with its own share: its query and KV heads (the KV pool holds only
those), its slice of the MLP, its rows of the embedding and the LM head.
q/k/v and gate/up are column-parallel (no communication), o_proj and
down_proj row-parallel (one all-reduce each), the embedding one all-reduce
and the LM head one all-gather: two all-reduces per layer in all.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from model_proc.attention.base import AttentionBackend, AttentionMetadata
from model_proc.layers import (HooklessModule, Linear, MatmulKernel, ParallelLMHead, RowParallelLinear,
                               VocabParallelEmbedding, apply_rope_, fold_norm_weight, head_rms_norm_,
                               move_packed_onto_huge_pages)
from model_proc.model_config import SUPPORTED_MODEL_TYPES, Activation, ModelConfig  # noqa: F401 (re-exported)
from model_proc.parallel import SINGLE, TensorParallel, shard_heads, shard_range
from model_proc.quant import QuantizedWeights
from model_proc.quant.weight import QuantWeight
from model_proc.row_blocks import pad_rows, padded_rows
from model_proc.weights import CheckpointReader

# a matmul weight as loaded: a float tensor, or quantized blocks
Weight = torch.Tensor | QuantWeight


def cat_rows(parts: list[Weight]) -> Weight:
    """Parts of a fused weight stacked by rows: blocks stay blocks; a float
    part among quantized ones (a type without a kernel here) makes the whole
    weight float."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])

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
    if kind == "longrope":  # the short factors; RotaryEmbedding switches to the long ones
        return longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3, longrope)")


def longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE: each frequency slowed by its own factor (as transformers rounds it)."""
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope: {len(factors)} factors for a head of {head_dim} (want {head_dim // 2})")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponent)


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

    longrope (Phi-3 128k): positions below original_max_position_embeddings
    take the short factors, those from it on the long ones, and both tables
    are scaled by the attention factor. transformers instead switches a whole
    sequence to the long factors once it is longer than that, which would
    re-rotate keys already in the KV pool: the same up to that length only
    (docs/architecture.md, the model forward).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim / 2]
        if scaling["rope_type"] == "longrope":
            orig = scaling["original_max_position_embeddings"]
            long_inv = longrope_inv_freq(head_dim, theta, scaling["long_factor"])
            freqs[orig:] = torch.outer(positions[orig:], long_inv)
            scale = scaling["attention_factor"]
            cos, sin = freqs.cos() * scale, freqs.sin() * scale
        else:
            cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim / 2]: broadcast over heads
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


# ---- layers -------------------------------------------------------------------------


class Attention(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.eps = cfg.rms_norm_eps  # input_layernorm's
        # this rank's heads (all of them at tp size 1)
        self.heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = self.heads.num_heads, self.heads.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.head_counts = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        # q, k and v in one matmul: one pass over the activations instead of three
        # (input_layernorm's weight is folded in)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp)
        # Gemma normalizes the output before the residual add (DecoderLayer does both)
        self.adds_residual = not cfg.sandwich_norms
        # Qwen3 and Gemma 3: q_norm's weight on every q head, then k_norm's on every k head
        # (the same weight for each head, so any tensor-parallel share of them)
        self.qk_norm = nn.Parameter(torch.empty(self.num_heads + self.num_kv_heads, cfg.head_dim),
                                    requires_grad=False) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x + attention(rms_norm(x)) (the norm fused into the q/k/v matmul);
        without the `x +` where the layer has post norms."""
        n = x.shape[0]
        heads = self.qkv_proj(x, norm_eps=self.eps).view(n, -1, self.head_dim)  # [T, q + k + v heads, head_dim]
        # q and k heads are adjacent in each row: rotate them in one pass, in
        # place. (narrow and split, not slicing: torch's indexing costs several
        # dispatches a slice, ~30 us a layer at batch 1)
        qk = heads.narrow(1, 0, self.num_heads + self.num_kv_heads)
        if self.qk_norm is not None:  # before rotary, as transformers' Qwen3
            head_rms_norm_(qk, self.qk_norm, self.eps)
        # quantized layers rotate with their matmul's native module, whatever the CPU
        apply_rope_(qk, cos, sin, self.qkv_proj.op if self.qkv_proj.kernel is MatmulKernel.QUANT else None)
        q, k, v = heads.split(self.head_counts, dim=1)
        o = self.backend.forward(q, k, v, self.layer_id, meta)
        return self.o_proj(o.reshape(n, self.q_size), add=x if self.adds_residual else None)


class MLP(HooklessModule):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # this rank's slice of the intermediate size
        self.eps = cfg.rms_norm_eps  # post_attention_layernorm's
        self.inter_start, inter_end = shard_range(cfg.intermediate_size, tp.rank, tp.size, "intermediate_size")
        self.inter = inter_end - self.inter_start
        # gate and up in one matmul, like qkv (the MLP's input norm's weight
        # folded in), its output SiLU(gate) * up (fused where the kernel can);
        # GELU (Gemma) applied here, after the matmul
        self.silu = cfg.activation is Activation.SILU
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias, gated=self.silu)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)
        self.adds_residual = not cfg.sandwich_norms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(rms_norm(x)) (the norm fused into the gate/up matmul);
        without the `x +` where the layer has post norms."""
        h = self.gate_up_proj(x, norm_eps=self.eps)
        if not self.silu:  # GELU-tanh(gate) * up, in place in the matmul's output
            h = F.gelu(h[:, :self.inter], approximate="tanh").mul_(h[:, self.inter:])
        return self.down_proj(h, add=x if self.adds_residual else None)


class DecoderLayer(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, backend, tp)
        self.mlp = MLP(cfg, tp)
        self.eps = cfg.rms_norm_eps
        # Gemma: post_attention_layernorm's and post_feedforward_layernorm's
        # (1 + w), on each block's output before its residual add. float32
        # whatever the model's dtype (as transformers scales), so not a
        # parameter the model's .to(dtype) would round: set by load_weights
        self.post_norms: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # each block normalizes its own input: the norms have no weight here
        # (folded into the next matmul) and run inside that matmul's call
        if self.post_norms is not None:  # Gemma
            x = x + self._post_norm(self.self_attn(x, cos, sin, meta), 0)
            return x + self._post_norm(self.mlp(x), 1)
        return self.mlp(self.self_attn(x, cos, sin, meta))

    def _post_norm(self, h: torch.Tensor, which: int) -> torch.Tensor:
        """Gemma's RMSNorm: in float32, times its weight, then rounded once."""
        assert self.post_norms is not None
        return F.rms_norm(h.float(), (h.shape[-1],), eps=self.eps).mul_(self.post_norms[which]).to(h.dtype)


class FusedDecoder(Protocol):
    """A step's decoder layers in one call, the same ops as the modules'
    forward (model_proc/native_decoder.py has the one there is; the runner
    sets it). Built for one backend: the model uses it only while its layers
    still use that backend."""
    backend: AttentionBackend

    @property
    def takes_verify(self) -> bool:
        """Whether it runs a speculative verify step (every token's logits)."""
        ...

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                tokens: int) -> torch.Tensor | None:
        """The layers' output, or None where the modules must run this step."""
        ...


class LlamaForCausalLM(nn.Module):
    # Switch for benchmarks and tests: False keeps every step on the modules'
    # forward (what the native decoder replaces; also where per-layer hooks see them).
    use_native_decoder = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 deterministic: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # batch-invariant forward (row_blocks.py); the backend must be one too
        self.deterministic = deterministic
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        # Gemma 3's sliding layers: a rope of their own (None: every layer the same)
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling or {"rope_type": "default"}, max_positions)
        self.local_layers = [w is not None for w in cfg.layer_windows] or [False] * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, tp) for i in range(cfg.num_layers))
        # its own matrix even when tied: the final norm's weight is folded in,
        # and on a CPU it is packed for the matmul, which the embedding lookup can't use
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = deterministic
        self.native_decoder: FusedDecoder | None = None  # set by the runner where one can run

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, extra_index: torch.Tensor | None = None,
                every_token: bool = False) -> torch.Tensor:
        """input_ids, positions [T] -> float32 logits [B, vocab] of each row's last token,
        followed by those of the tokens at flat indices `extra_index` (prompt
        logprobs: only the positions some row asked for pay for the head).
        every_token: [T, vocab], every new token's (a speculative verify)."""
        num_tokens = input_ids.shape[0]
        if self.deterministic:
            # whole row blocks: torch's thread split of a per-token op then
            # falls between tokens, never inside one (row_blocks.py)
            rows = padded_rows(num_tokens)
            input_ids, positions = pad_rows(input_ids, rows), pad_rows(positions, rows)
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:  # Gemma: by sqrt(hidden) rounded to the dtype, as transformers
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        fused = self.native_decoder
        out = fused.forward(x, cos, sin, meta, num_tokens) if fused is not None and self.use_native_decoder \
            and (not every_token or fused.takes_verify) and self.layers[0].self_attn.backend is fused.backend \
            else None
        if out is not None:
            x = out
        else:
            local = None if self.local_rotary is None else self.local_rotary(positions, x.dtype)
            for layer, is_local in zip(self.layers, self.local_layers):
                x = layer(x, *(local if local is not None and is_local else (cos, sin)), meta)
        # only the last token of each row is sampled: skip the rest of the
        # (vocab-sized) head for the prompt tokens of an extend
        last = x[:num_tokens] if meta.is_decode or every_token else x[meta.qo_indptr[1:] - 1]
        if extra_index is not None and extra_index.numel():
            last = torch.cat([last, x[extra_index]])
        logits = self.lm_head(last, norm_eps=self.cfg.rms_norm_eps).float()
        cap = self.cfg.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    @torch.no_grad()
    def load_weights(self, ckpt: CheckpointReader, quantized: QuantizedWeights | None = None) -> None:
        """Read this rank's shard of every weight from a Hugging Face checkpoint,
        tensor by tensor (fusing q/k/v and gate/up, folding each RMSNorm weight
        into the next matmul), then prepare the matmuls for the device. Call
        after the model is on its device and dtype. `quantized`: the matmul
        weights (and embedding) it holds are taken from there as blocks, the
        norm weight before each kept as its input scale."""
        def put(param: nn.Parameter | None, tensor: torch.Tensor, name: str, pad: bool = False) -> None:
            """name: the checkpoint tensor (the first, for a fused one) a wrong
            shape is reported as; pad: the last rank's vocabulary slice may be
            short, its missing rows are zero."""
            assert param is not None
            n = tensor.shape[0]
            if param.shape[1:] != tensor.shape[1:] or (n != param.shape[0] and not (pad and n < param.shape[0])):
                raise ValueError(f"weight {name!r} has the wrong shape for the config: read {tuple(tensor.shape)}, "
                                 f"need {tuple(param.shape)} (this rank's share)")
            param[:n].copy_(tensor)
            param[n:].zero_()

        cfg, hd = self.cfg, self.cfg.head_dim

        def norm(name: str, size: int = cfg.hidden_size, rounded_to: torch.dtype | None = None) -> torch.Tensor:
            """A norm's weight as it scales: Gemma's 1 + w (in float32);
            rounded_to: w first rounded to that dtype, as transformers holds it."""
            w = ckpt.read(name)
            if tuple(w.shape) != (size,):
                raise ValueError(f"weight {name!r} has the wrong shape for the config: read {tuple(w.shape)}, "
                                 f"need {(size,)}")
            if rounded_to is not None:
                w = w.to(rounded_to)
            return w.float() + cfg.norm_weight_offset if cfg.norm_weight_offset else w

        def check(name: str, *shape: int) -> str:
            """The checkpoint tensor's whole shape is what the config implies
            (checked before a shard of it is read, which would hide a wrong size)."""
            got = tuple(ckpt.shape(name))
            if got != shape:
                raise ValueError(f"weight {name!r} has the wrong shape for the config: {got}, need {shape}")
            return name

        def put_linear(lin: Linear | VocabParallelEmbedding, w: Weight, name: str, pad: bool = False) -> None:
            if not isinstance(w, QuantWeight):
                put(lin.weight, w, name, pad)
                return
            n, k = w.shape
            if k != lin.weight.shape[1] or not (n == lin.weight.shape[0] or (pad and n < lin.weight.shape[0])):
                raise ValueError(f"weight {name!r} has the wrong shape for the config: read {(n, k)}, "
                                 f"need {tuple(lin.weight.shape)} (this rank's share)")
            lin.set_quantized(w)

        def weight(name: str, dim: int, start: int, end: int) -> Weight:
            """[start, end) of a matmul weight along `dim`: blocks where `quantized` has them."""
            q = quantized.get(name) if quantized is not None else None
            if q is None:
                return ckpt.read(name, dim, start, end)
            return q.rows(start, end) if dim == 0 else q.columns(start, end)

        def rows(name: str, start: int, end: int) -> Weight:
            return weight(name, 0, start, end)

        def fold(w: Weight, norm_weight: torch.Tensor) -> Weight:
            return w.scaled_input(norm_weight) if isinstance(w, QuantWeight) else fold_norm_weight(w, norm_weight)

        def parts(names: list[str], fused: str, sizes: list[int], spans: list[tuple[int, int]]) -> Weight:
            """This rank's rows of each part, stacked: from the parts' own
            tensors, or (Phi-3) from the one tensor holding them end to end."""
            cols = (cfg.hidden_size,) if names[0].endswith("weight") else ()
            if not cfg.fused_checkpoint:
                return cat_rows([rows(check(name, size, *cols), a, b)
                                 for name, size, (a, b) in zip(names, sizes, spans)])
            check(fused, sum(sizes), *cols)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            return cat_rows([rows(fused, off + a, off + b) for off, (a, b) in zip(offsets, spans)])

        def qkv(layer: Attention, p: str, kind: str) -> Weight:
            h = layer.heads
            q = (h.q_start * hd, (h.q_start + h.num_heads) * hd)
            kv = (h.kv_start * hd, (h.kv_start + h.num_kv_heads) * hd)
            return parts([f"{p}q_proj.{kind}", f"{p}k_proj.{kind}", f"{p}v_proj.{kind}"], f"{p}qkv_proj.{kind}",
                         [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], [q, kv, kv])

        def gate_up(mlp: MLP, p: str, kind: str) -> Weight:
            span = (mlp.inter_start, mlp.inter_start + mlp.inter)
            return parts([f"{p}gate_proj.{kind}", f"{p}up_proj.{kind}"], f"{p}gate_up_proj.{kind}",
                         [cfg.intermediate_size] * 2, [span, span])

        emb = self.embed_tokens
        check("model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size)
        put_linear(emb, rows("model.embed_tokens.weight", emb.start, emb.end), "model.embed_tokens.weight", pad=True)
        head = self.lm_head
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        check(head_name, cfg.vocab_size, cfg.hidden_size)
        put_linear(head, fold(rows(head_name, head.start, head.end), norm("model.norm.weight")), head_name, pad=True)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            a = f"{p}self_attn."
            put_linear(attn.qkv_proj, fold(qkv(attn, a, "weight"), norm(f"{p}input_layernorm.weight")),
                       f"{a}q_proj.weight")
            if attn.qkv_proj.bias is not None:
                put(attn.qkv_proj.bias, qkv(attn, a, "bias"), f"{a}q_proj.bias")
            if attn.qk_norm is not None:
                q_norm, k_norm = norm(f"{a}q_norm.weight", hd), norm(f"{a}k_norm.weight", hd)
                put(attn.qk_norm, torch.cat([q_norm.expand(attn.num_heads, hd), k_norm.expand(attn.num_kv_heads, hd)]),
                    f"{a}q_norm.weight")
            q0, q1 = attn.heads.q_start * hd, (attn.heads.q_start + attn.heads.num_heads) * hd
            check(f"{a}o_proj.weight", cfg.hidden_size, cfg.num_heads * hd)
            put_linear(attn.o_proj, weight(f"{a}o_proj.weight", 1, q0, q1), f"{a}o_proj.weight")
            if attn.o_proj.bias is not None:  # rank 0 only: added once, before the all-reduce
                put(attn.o_proj.bias, ckpt.read(f"{a}o_proj.bias"), f"{a}o_proj.bias")
            m = f"{p}mlp."
            # Gemma's MLP input norm is pre_feedforward_layernorm; its
            # post_attention_layernorm normalizes the attention output
            mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
            put_linear(mlp.gate_up_proj, fold(gate_up(mlp, m, "weight"), norm(f"{p}{mlp_norm}.weight")),
                       f"{m}gate_proj.weight")
            if cfg.sandwich_norms:  # w in the model's dtype, then 1 + w in float32, as transformers
                dtype, device = emb.weight.dtype, emb.weight.device
                layer.post_norms = torch.stack([
                    norm(f"{p}{name}.weight", rounded_to=dtype)
                    for name in ("post_attention_layernorm", "post_feedforward_layernorm")]).to(device)
            if mlp.gate_up_proj.bias is not None:
                put(mlp.gate_up_proj.bias, gate_up(mlp, m, "bias"), f"{m}gate_proj.bias")
            check(f"{m}down_proj.weight", cfg.hidden_size, cfg.intermediate_size)
            put_linear(mlp.down_proj, weight(f"{m}down_proj.weight", 1, mlp.inter_start, mlp.inter_start + mlp.inter),
                       f"{m}down_proj.weight")
            if mlp.down_proj.bias is not None:
                put(mlp.down_proj.bias, ckpt.read(f"{m}down_proj.bias"), f"{m}down_proj.bias")
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for lin in linears:
            lin.prepare()
        move_packed_onto_huge_pages(linears)
