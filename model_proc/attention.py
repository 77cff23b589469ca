"""Attention over the paged KV pool.

A backend does two things: `init_forward_metadata` once per step (index
tensors built from the ForwardBatch and `req_to_token`), and `forward` in
every layer (store the new K/V into their slots, then attend). The model sees
only this interface, so a Triton backend can replace the torch one.

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
import torch.nn.functional as F

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


def _indptr(lens: torch.Tensor) -> torch.Tensor:
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


@dataclass
class TorchAttnMetadata(AttentionMetadata):
    # extend: host copies for the per-row loop, and one mask per row whose
    # prefix is in the pool (None: plain causal over the new tokens only)
    qo_bounds: list[tuple[int, int]] | None = None
    kv_bounds: list[tuple[int, int]] | None = None
    row_masks: list[torch.Tensor | None] | None = None
    # decode: a padded [B, max_len] slot matrix (padding -> dummy slot 0) and
    # the [B, 1, 1, max_len] mask of real entries, built once, used per layer
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    max_len: int = 0


class TorchAttnBackend(AttentionBackend):
    """CPU (or any device) attention with torch ops only."""

    def init_forward_metadata(self, batch: ForwardBatch, out_cache_loc: torch.Tensor) -> TorchAttnMetadata:
        device = out_cache_loc.device
        table = self.req_to_token.table
        bs = len(batch.seq_lens)
        rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        kv_indptr = _indptr(seq_lens)
        total_kv = sum(batch.seq_lens)
        if batch.forward_mode == "decode":
            max_len = max(batch.seq_lens)
            cols = torch.arange(max_len, device=device)
            valid = cols[None, :] < seq_lens[:, None]
            slots = table[rows, :max_len].to(torch.int64).masked_fill_(~valid, 0)
            return TorchAttnMetadata(
                forward_mode="decode", batch_size=bs,
                qo_indptr=torch.arange(bs + 1, dtype=torch.int64, device=device),
                kv_indptr=kv_indptr, kv_indices=slots[valid], seq_lens=seq_lens,
                prefix_lens=seq_lens - 1, out_cache_loc=out_cache_loc,
                decode_slots=slots.flatten(), decode_mask=valid[:, None, None, :], max_len=max_len)

        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        ext_lens = [s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)]
        qo_bounds, kv_bounds, row_masks = [], [], []
        q0 = k0 = 0
        for n, s, p in zip(ext_lens, batch.seq_lens, batch.prefix_lens):
            qo_bounds.append((q0, q0 + n))
            kv_bounds.append((k0, k0 + s))
            q0, k0 = q0 + n, k0 + s
            # query j sits at position p + j and sees keys 0..p + j
            row_masks.append(None if p == 0 else
                             torch.arange(s, device=device)[None, :]
                             <= torch.arange(p, s, device=device)[:, None])
        return TorchAttnMetadata(
            forward_mode="extend", batch_size=bs,
            qo_indptr=_indptr(seq_lens - prefix_lens), kv_indptr=kv_indptr,
            kv_indices=gather_kv_indices(table, rows, seq_lens, kv_indptr, total_kv),
            seq_lens=seq_lens, prefix_lens=prefix_lens, out_cache_loc=out_cache_loc,
            qo_bounds=qo_bounds, kv_bounds=kv_bounds, row_masks=row_masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        self.kv_pool.store(layer_id, meta.out_cache_loc, k, v)
        if meta.is_decode:
            return self._decode(q, layer_id, meta)
        return self._extend(q, k, v, layer_id, meta)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: TorchAttnMetadata) -> torch.Tensor:
        bs, max_len = meta.batch_size, meta.max_len
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        num_kv_heads, head_dim = k_buf.shape[1], k_buf.shape[2]
        # [B, max_len, kv_heads, D] -> [B, kv_heads, max_len, D]
        k = k_buf.index_select(0, meta.decode_slots).view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v_buf.index_select(0, meta.decode_slots).view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=meta.decode_mask,
                                             scale=self.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        out = torch.empty_like(q)
        for (q0, q1), (k0, k1), mask in zip(meta.qo_bounds, meta.kv_bounds, meta.row_masks):
            if mask is None:  # no prefix: the new tokens are the whole row
                rk, rv = k[q0:q1], v[q0:q1]
            else:
                slots = meta.kv_indices[k0:k1]
                rk, rv = k_buf[slots], v_buf[slots]
            o = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), rk.transpose(0, 1), rv.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
            out[q0:q1] = o.transpose(0, 1)
        return out


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenTable,
                             scale: float) -> AttentionBackend:
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token, scale)
    raise ValueError(f"attention backend {name!r} is not available")
