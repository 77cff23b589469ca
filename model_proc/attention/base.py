"""What every attention backend is: `init_forward_metadata` once per step
(from the step's StepInputs, after the runner wrote the step's slots into
`req_to_token`), `forward` in every layer (store the new K/V into their
slots, then attend). The model sees only this interface.

The common metadata is the step's StepInputs (model_proc/step_inputs.py;
B rows, T new tokens, all index tensors int64):
  qo_indptr  [B+1]  row i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]]
  kv_indptr  [B+1]  row i's whole KV (prefix + new) is
  kv_indices [sum seq_lens]   kv_indices[kv_indptr[i]:kv_indptr[i+1]] (slots)
  seq_lens, prefix_lens [B]; out_cache_loc [T] (slot of every new token)
A backend's metadata adds what its kernels need on top.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.model_config import ModelConfig
from model_proc.step_inputs import StepInputs


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes beyond softmax(q.k * scale) v.

    window: a query at position i sees the keys at i - window < j <= i
    (transformers' sliding window: itself and window - 1 before it); None,
    every earlier key. softcap (Gemma 2): each scaled score s becomes
    softcap * tanh(s / softcap) before the softmax."""
    window: int | None = None
    softcap: float | None = None


FULL = LayerAttention()


def layer_attention(cfg: ModelConfig) -> list[LayerAttention]:
    """The model's per-layer attention, from its config."""
    return [LayerAttention(w, cfg.attn_softcap) for w in cfg.layer_windows] or [FULL] * cfg.num_layers


@dataclass
class WindowKV:
    """A decode step's KV restricted to each row's last `window` tokens: what
    a decoding token of a sliding layer attends (kv_indptr/kv_indices in the
    form of the step's own; max_len its longest row)."""
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_len: int


def window_kv(inputs: StepInputs, window: int) -> WindowKV:
    """Each row's last min(seq_len, window) slots of the step's kv_indices:
    a decode token at position s - 1 sees keys s - window .. s - 1."""
    lens = inputs.seq_lens.clamp(max=window)
    indptr = torch.zeros_like(inputs.kv_indptr)
    torch.cumsum(lens, 0, out=indptr[1:])
    total = sum(min(s, window) for s in inputs.seq_lens_host)
    # the first kept slot of row i sits at kv_indptr[i] + seq_len - len
    shift = inputs.kv_indptr[:-1] + inputs.seq_lens - lens - indptr[:-1]
    at = torch.arange(total, device=lens.device) + torch.repeat_interleave(shift, lens, output_size=total)
    return WindowKV(indptr, inputs.kv_indices[at], min(inputs.max_seq_len, window))


@dataclass
class AttentionMetadata:
    inputs: StepInputs  # the step's (or one part's, in a mixed step split by the native backend)
    # decode: the windowed KV of each window a layer uses, built by its first layer
    windows: dict[int, WindowKV] = field(default_factory=dict, kw_only=True)
    # with a window pool: the step's slot tensors in the sliding layers'
    # numbering (AttentionBackend.layer_slots), made by the first such layer
    in_window: dict[Any, Any] = field(default_factory=dict, kw_only=True)

    def window_kv(self, window: int) -> WindowKV:
        kv = self.windows.get(window)
        if kv is None:
            kv = self.windows[window] = window_kv(self.inputs, window)
        return kv

    @property
    def is_decode(self) -> bool:
        return self.inputs.is_decode

    @property
    def batch_size(self) -> int:
        return self.inputs.batch_size

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.inputs.qo_indptr

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.inputs.kv_indptr

    @property
    def kv_indices(self) -> torch.Tensor:
        return self.inputs.kv_indices

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.inputs.seq_lens

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.inputs.prefix_lens

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.inputs.out_cache_loc


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale
        # per layer id (default: full attention, no cap)
        self.layers = list(layers) if layers is not None else [FULL] * kv_pool.num_layers
        if len(self.layers) != kv_pool.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for a pool of {kv_pool.num_layers} layers")

    def layer_slots(self, meta: AttentionMetadata, layer_id: int, key: str, slots: torch.Tensor) -> torch.Tensor:
        """`slots` (the step's, in the full pool's numbering; `key` names
        them for the step's cache) as layer_id's buffers number them: the
        same, but for a sliding layer with a window pool."""
        if not self.kv_pool.windowed[layer_id]:
            return slots
        out = meta.in_window.get(key)
        if out is None:
            out = meta.in_window[key] = self.kv_pool.to_window(slots)
        return out

    def layer_window_kv(self, meta: AttentionMetadata, layer_id: int) -> WindowKV:
        """A sliding layer's decode KV (each row's last `window` slots), as
        its buffers number them."""
        window = self.layers[layer_id].window
        assert window is not None
        kv = meta.window_kv(window)
        if not self.kv_pool.windowed[layer_id]:
            return kv
        out = meta.in_window.get(window)
        if out is None:
            out = meta.in_window[window] = WindowKV(kv.kv_indptr, self.kv_pool.to_window(kv.kv_indices), kv.max_len)
        return out

    @abstractmethod
    def init_forward_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """Called once per step, after the runner wrote this step's slots into
        `req_to_token`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, q_heads, D], k/v [T, kv_heads, D] of the new tokens -> [T, q_heads, D]."""
