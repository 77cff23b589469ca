"""The fused native decoder: a step's decoder layers as one call of
layers.cpp's `DecoderStack`, where every piece of the step is native. It
drives the native attention op directly, so it lives here beside the runner
(which builds it) rather than in the model, which knows no particular
attention backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from model_proc.attention.base import AttentionMetadata
from model_proc.attention.native import MixedAttnMetadata, NativeAttnBackend, NativeAttnMetadata
from model_proc import native
from model_proc.layers import STEP_OPS_DTYPES, Linear, MatmulKernel, native_layers_op, native_step_ops
from model_proc.quant import weight as quant_weight
from model_proc.quant.matmul import GEMV_MAX_ROWS
from model_proc.model_config import Activation

if TYPE_CHECKING:
    from model_proc.model import LlamaForCausalLM


@dataclass
class NativeDecoder:
    """A step's decoder layers as one native call (layers.cpp `DecoderStack`):
    the same ops as the modules' forward, in the same order and on the same
    tensors, so the same bits, without Python between them. Built for one
    native attention backend's KV pool: the model takes it only while its
    layers still use that backend, and for steps whose attention is all the
    op's (NativeAttnMetadata: decode rows always; extend rows where the
    backend's `native_extend` is on)."""
    op: Any  # the layers module, for its AttnPart
    stack: Any  # layers.cpp DecoderStack
    backend: NativeAttnBackend
    # quantized layers (GGUF blocks): their products run on few rows only
    # (the gemv's and the 8-bit kernel's row limits; above, the modules'
    # dequantized tiles), and a verify step is theirs too
    quantized: bool = False
    q8_ready: bool = False  # every segment has an 8-bit-activation kernel

    @property
    def takes_verify(self) -> bool:
        """Whether it runs a verify step (every token's logits): the quantized
        stack's products are the same per row at any row count up to its limit."""
        return self.quantized

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                tokens: int) -> torch.Tensor | None:
        """The layers' output, or None where the modules must run the step."""
        q8 = False
        if self.quantized:
            q8 = quant_weight.use_q8_activations and self.q8_ready
            if x.dtype not in STEP_OPS_DTYPES or tokens > (quant_weight.Q8_MAX_ROWS if q8 else GEMV_MAX_ROWS):
                return None
        parts = self.parts(meta, tokens)
        return None if parts is None else self.stack.forward(x, cos, sin, parts, q8)

    def parts(self, meta: AttentionMetadata, tokens: int) -> list[Any] | None:
        """The step's attention parts for the stack, or None where the
        modules must run it (rows the backend's torch path attends)."""
        if type(meta) is NativeAttnMetadata:
            return [self._part(meta, 0, tokens)]
        if type(meta) is not MixedAttnMetadata:
            return None
        # a mixed step: its extend rows' tokens first, then its decoding rows'
        assert meta.decode is not None
        if meta.extend is None:
            return [self._part(meta.decode, 0, tokens)]
        if type(meta.extend) is not NativeAttnMetadata:
            return None
        t = meta.decode_token
        return [self._part(meta.extend, 0, t), self._part(meta.decode, t, tokens - t)]

    def _part(self, meta: NativeAttnMetadata, start: int, count: int) -> Any:
        decode = meta.is_decode
        return self.op.AttnPart(decode, start, count, meta.max_len, None if decode else meta.qo_indptr,
                                meta.kv_indptr, meta.kv_indices, meta.out_cache_loc)


def build_native_decoder(model: LlamaForCausalLM) -> NativeDecoder | None:
    """The model's native decoder where every piece of a step is native here,
    on one rank, without --deterministic (its fixed-size row blocks are
    Python's), with the native attention op on a float pool, and for layers
    made only of the ops it has: Llama's (not Qwen3's or Gemma's q/k norms,
    not Gemma's extra norms and GELU, no sliding window). Its matmuls: all
    bfloat16 on the native kernel (AMX or AVX512_BF16), or all on quantized
    blocks (GGUF types; any CPU, bfloat16 or float32 activations)."""
    backend = model.layers[0].self_attn.backend
    layer_linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    cfg = model.cfg
    if cfg.qk_norm or cfg.sandwich_norms or cfg.activation is not Activation.SILU or cfg.sliding \
            or cfg.embed_scale is not None:  # steps DecoderStack does not have
        return None
    if model.tp.size > 1 or model.deterministic or not isinstance(backend, NativeAttnBackend) \
            or backend.op is None or backend.kv_pool.int8:
        return None  # (an int8 pool: the stack calls the float decode op)
    device = model.embed_tokens.weight.device
    if all(lin.kernel is MatmulKernel.QUANT for lin in layer_linears):
        return _quantized_decoder(model, backend, native_step_ops(device))
    if any(lin.kernel is not MatmulKernel.NATIVE for lin in layer_linears):
        return None
    op = native_layers_op(device)
    stack = _stack(model, backend, op)
    pool = backend.kv_pool
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        stack.add_layer(a.qkv_proj.packed, a.qkv_proj.packed_bias, a.o_proj.packed, a.o_proj.packed_bias,
                        m.gate_up_proj.packed, m.gate_up_proj.packed_bias, m.down_proj.packed,
                        m.down_proj.packed_bias, pool.k_buffer[i], pool.v_buffer[i])
    return NativeDecoder(op, stack, backend)


def _stack(model: LlamaForCausalLM, backend: NativeAttnBackend, op: Any) -> Any:
    attn0, cfg = model.layers[0].self_attn, model.cfg
    return op.DecoderStack(backend.op.decode_fn, backend.op.extend_fn, attn0.num_heads, attn0.num_kv_heads,
                           cfg.head_dim, cfg.hidden_size, model.layers[0].mlp.inter, cfg.rms_norm_eps, backend.scale)


def _quantized_decoder(model: LlamaForCausalLM, backend: NativeAttnBackend, op: Any) -> NativeDecoder | None:
    """The stack on quantized layers: each product QuantWeight.matmul's
    kernels (quant.cpp's gemv, quant_dot.cpp's 8-bit one) by their addresses."""
    gemv = native.load(name="quant")
    if op is None or gemv is None:
        return None
    q8 = native.load(name="quant_dot")
    stack = _stack(model, backend, op)
    pool = backend.kv_pool

    def mat(lin: Linear) -> Any:
        w = lin.quantized
        assert w is not None
        return op.QuantMat([(int(s.qtype), s.blocks) for s in w.segments], w.input_scale, lin.packed_bias)

    weights = []
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        stack.add_quant_layer(mat(a.qkv_proj), mat(a.o_proj), mat(m.gate_up_proj), mat(m.down_proj),
                              pool.k_buffer[i], pool.v_buffer[i], gemv.gemv_fn, None if q8 is None else q8.matmul_q8_fn)
        weights += [lin.quantized for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
    q8_ready = q8 is not None and all(w.q8_ready() for w in weights)
    return NativeDecoder(op, stack, backend, quantized=True, q8_ready=q8_ready)
