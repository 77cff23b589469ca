"""Decode attention over the paged KV pool: one query token per row.

Two stages (flash-decoding), so that one long row is spread over several
programs instead of one program walking all of it:

  stage 1, grid (batch, kv_heads, num_kv_splits): a program takes every query
    head of one KV-head group (GQA: the group reads its K/V once) and one
    contiguous split of the row's KV, and writes the split's normalised
    partial output and its log-sum-exp;
  stage 2, grid (batch, q_heads): merge the splits by their log-sum-exp.

Inputs: q [B, Hq, D]; k_buffer/v_buffer [slots, Hkv, D(v)]; row i's KV is at
slots kv_indices[kv_indptr[i]:kv_indptr[i+1]] (at least one per row).
`logit_cap` c > 0 replaces each scaled score s by c * tanh(s / c) (Gemma 2/3).
A sliding window needs nothing here: the caller passes each row's last
`window` slots only.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.tiling import block_dim, dot_precision

BLOCK_N = 32  # KV tokens per inner step; the group's heads are padded to >= 16 rows for tl.dot
MAX_KV_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 64  # below this a split costs more in merging than it saves


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), written with sigmoid: tl has no tanh that both the
    interpreter and the compiler accept. Saturates to +-cap, never NaN."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _decode_stage1_kernel(
    Q, K_Buffer, V_Buffer, kv_indptr, kv_indices, Mid_O, Mid_Lse, sm_scale, logit_cap, num_kv_splits,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_CAP: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V

    kv_start = tl.load(kv_indptr + row)
    seq_len = tl.load(kv_indptr + row + 1) - kv_start
    split_len = tl.cdiv(seq_len, num_kv_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    if lo < hi:  # trailing splits of a short row are empty; stage 2 skips them
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(K_Buffer + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_H, BLOCK_N]
            if HAS_CAP:
                qk = _soft_cap(qk, logit_cap)
            # padded head rows hold q = 0, so their scores stay finite: only
            # the token mask is needed, and no row becomes all -inf
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_Buffer + slot[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                        mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Mid_O + row * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :],
                 out, mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(Mid_Lse + row * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Mid_O, Mid_Lse, O, kv_indptr, num_kv_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    seq_len = tl.load(kv_indptr + row + 1) - tl.load(kv_indptr + row)
    split_len = tl.cdiv(seq_len, num_kv_splits)

    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in range(0, num_kv_splits):
        if split * split_len < seq_len:  # same split bounds as stage 1
            part = tl.load(Mid_O + row * stride_mb + head * stride_mh + split * stride_ms + offs_dv,
                           mask=mask_dv, other=0.0)
            lse = tl.load(Mid_Lse + row * stride_lb + head * stride_lh + split)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + part * w
            denom = denom * alpha + w
            m = m_new
    tl.store(O + row * stride_ob + head * stride_oh + offs_dv, (acc / denom).to(O.dtype.element_ty),
             mask=mask_dv)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, max_seq_len: int,
                         device: torch.device) -> int:
    """Enough stage-1 programs to keep every SM busy (about two per SM), but
    no split shorter than MIN_TOKENS_PER_SPLIT; a power of two up to
    MAX_KV_SPLITS."""
    if device.type == "cuda":
        sms = _num_sms(torch.cuda.current_device() if device.index is None else device.index)
    else:
        sms = 2  # the interpreter: every program costs, keep grids small
    want = math.ceil(2 * sms / max(1, batch_size * num_kv_heads))
    cap = max(1, min(MAX_KV_SPLITS, max_seq_len // MIN_TOKENS_PER_SPLIT))
    splits = 1
    while splits < want and splits * 2 <= cap:
        splits *= 2
    return splits


def decode_scratch(batch_size: int, num_q_heads: int, head_dim_v: int, num_kv_splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 outputs (partial outputs, log-sum-exps), float32; allocate once
    per step and share between layers."""
    mid_o = torch.empty(batch_size, num_q_heads, num_kv_splits, head_dim_v, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch_size, num_q_heads, num_kv_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         sm_scale: float, num_kv_splits: int,
                         scratch: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                         logit_cap: float = 0.0) -> torch.Tensor:
    """o [B, Hq, Dv] = softmax(cap(q k^T * sm_scale)) v over each row's pages;
    logit_cap 0: no soft-capping."""
    assert logit_cap >= 0.0
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == k_buffer.stride(2) == v_buffer.stride(2) == o.stride(2) == 1
    group = num_q_heads // num_kv_heads
    if scratch is None:
        scratch = decode_scratch(batch, num_q_heads, head_dim_v, num_kv_splits, q.device)
    mid_o, mid_lse = scratch
    assert mid_o.shape[2] >= num_kv_splits

    _decode_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse, sm_scale, logit_cap, num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=block_dim(group), BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        BLOCK_D=block_dim(head_dim),
        BLOCK_DV=block_dim(head_dim_v),
        DOT_PRECISION=dot_precision(q.dtype), HAS_CAP=logit_cap > 0, num_warps=4, num_stages=2,
    )
    _decode_stage2_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, o, kv_indptr, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dim(head_dim_v), num_warps=4,
    )
    return o


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                         logit_cap: float = 0.0) -> torch.Tensor:
    """Plain per-row torch, in float32: the definition the kernel must match."""
    group = q.shape[1] // k_buffer.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[2], dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        slots = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * sm_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out.to(q.dtype)
