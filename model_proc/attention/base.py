"""What every attention backend is: `init_forward_metadata` once per step
(index tensors built from the ForwardBatch and `req_to_token`), `forward` in
every layer (store the new K/V into their slots, then attend). The model sees
only this interface.

Layout of the common metadata (B rows, T new tokens):
  qo_indptr  [B+1]  row i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]]
  kv_indptr  [B+1]  row i's whole KV (prefix + new) is
  kv_indices [sum seq_lens]   kv_indices[kv_indptr[i]:kv_indptr[i+1]] (slots)
  (all index tensors are int64)
  seq_lens, prefix_lens [B]; out_cache_loc [T] (slot of every new token)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.messages import ForwardBatch
from model_proc.kv_cache import KVPool, ReqToTokenTable


@dataclass
class AttentionMetadata:
    forward_mode: str  # "extend" or "decode"
    batch_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return self.forward_mode == "decode"


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> AttentionMetadata:
        """Called once per step, after the runner wrote this step's slots into
        `req_to_token`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, q_heads, D], k/v [T, kv_heads, D] of the new tokens -> [T, q_heads, D]."""


def indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def gather_kv_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                      kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate table[rows[i], :seq_lens[i]] over rows, without a Python loop."""
    row_of = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), seq_lens,
                                     output_size=total)
    col = torch.arange(total, device=rows.device) - kv_indptr[:-1][row_of]
    return table[rows[row_of], col].to(torch.int64)
