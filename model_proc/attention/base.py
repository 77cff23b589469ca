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
from dataclasses import dataclass

import torch

from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.step_inputs import StepInputs


@dataclass
class AttentionMetadata:
    inputs: StepInputs  # the step's (or one part's, in a mixed step split by the native backend)

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
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """Called once per step, after the runner wrote this step's slots into
        `req_to_token`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, q_heads, D], k/v [T, kv_heads, D] of the new tokens -> [T, q_heads, D]."""
