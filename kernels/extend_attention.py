"""Extend (prefill) attention, ragged across requests.

Row i has new tokens q/k/v_extend[qo_indptr[i]:qo_indptr[i+1]] and a prefix
already in the pool at slots kv_indices[kv_indptr[i]:kv_indptr[i+1]] (empty
for a fresh prompt). New token j (position prefix + j) attends to the whole
prefix and causally to new tokens 0..j.

Gemma 2/3 options, both off by default: `sliding_window` W > 0 narrows what
query position i sees to keys at positions (i - W, i] (itself and W - 1
earlier tokens); `logit_cap` c > 0 replaces each scaled score s by
c * tanh(s / c) before the softmax.

Grid (batch, q_heads, query blocks): each program walks the prefix pages
first (no mask beyond the page count), then the new tokens up to its block's
diagonal, with one online softmax over both. The new tokens are read from
k/v_extend, which are contiguous, rather than through the pool. With a
window, both walks start at the first key the block's first query can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tiling import block_dim, dot_precision


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), written with sigmoid: tl has no tanh that both the
    interpreter and the compiler accept. Saturates to +-cap, never NaN."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _extend_attention_kernel(
    Q, K_Ext, V_Ext, O, K_Buffer, V_Buffer, qo_indptr, kv_indptr, kv_indices, sm_scale,
    sliding_window, logit_cap,
    stride_qt, stride_qh, stride_ket, stride_keh, stride_vet, stride_veh, stride_ot, stride_oh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(qo_indptr + row)
    ext_len = tl.load(qo_indptr + row + 1) - q_start
    pre_start = tl.load(kv_indptr + row)
    pre_len = tl.load(kv_indptr + row + 1) - pre_start

    if block_m * BLOCK_M < ext_len:  # the grid is sized for the longest row
        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < HEAD_DIM_V
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # Absolute positions: prefix key n is at n, new token n at pre_len + n.
        # With a window, query i sees keys (i - sliding_window, i]; keys before
        # the block's first query's window are seen by no query of the block.
        first_pre = 0  # first prefix key and first new token any query of the block sees
        first_ext = 0
        if HAS_WINDOW:
            first_pre = tl.maximum(pre_len + block_m * BLOCK_M - sliding_window + 1, 0)
            first_ext = tl.maximum(first_pre - pre_len, 0)

        # 1) the prefix in the pool: without a window every query sees all of it
        for start in range(first_pre, pre_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < pre_len
            slot = tl.load(kv_indices + pre_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(K_Buffer + slot[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale
            if HAS_CAP:
                qk = _soft_cap(qk, logit_cap)
            visible = mask_n[None, :]
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > pre_len + offs_m[:, None] - sliding_window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_exp = m_new
            if HAS_WINDOW:
                # a later query of the block may see none of this block yet:
                # its row must give exp(-inf) = 0, not exp(-inf - -inf) = NaN
                m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_exp[:, None])
            alpha = tl.exp(m_i - m_exp)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_Buffer + slot[:, None] * stride_vbt + kv_head * stride_vbh + offs_dv[None, :],
                        mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # 2) the new tokens, causally: nothing past this block's last query.
        # Without a window key 0 is visible to every query, so after the first
        # block no row is all -inf (no NaN from exp(-inf - -inf)).
        end = tl.minimum(ext_len, (block_m + 1) * BLOCK_M)
        for start in range(first_ext, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < ext_len
            k = tl.load(K_Ext + (q_start + offs_n)[None, :] * stride_ket + kv_head * stride_keh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale
            if HAS_CAP:
                qk = _soft_cap(qk, logit_cap)
            visible = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - sliding_window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_exp = m_new
            if HAS_WINDOW:
                m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_exp[:, None])
            alpha = tl.exp(m_i - m_exp)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_Ext + (q_start + offs_n)[:, None] * stride_vet + kv_head * stride_veh + offs_dv[None, :],
                        mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # every real query sees at least itself, so l_i > 0 on the stored rows
        if HAS_WINDOW:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows past ext_len may see nothing
        out = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def _block_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Bigger tiles amortise the K/V loads on a
    GPU; register pressure grows with head_dim, so large heads get smaller
    ones. The interpreter pays per program and per op, so it gets the GPU's."""
    if head_dim <= 64:
        return 128, 64, 4
    if head_dim <= 128:
        return 64, 64, 4
    return 32, 32, 8


def extend_attention_fwd(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         max_extend_len: int, sm_scale: float, *, sliding_window: int = 0,
                         logit_cap: float = 0.0) -> torch.Tensor:
    """o [T, Hq, Dv] for the T new tokens (q [T, Hq, D], k/v_extend [T, Hkv, D]);
    kv_indptr/kv_indices describe each row's prefix only. sliding_window 0:
    full attention; logit_cap 0: no soft-capping."""
    assert sliding_window >= 0 and logit_cap >= 0.0
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_extend.shape[1], v_extend.shape[2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    for t in (q, k_extend, v_extend, o, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    batch = qo_indptr.numel() - 1
    block_m, block_n, warps = _block_sizes(head_dim)
    grid = (batch, num_q_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, sm_scale,
        sliding_window, logit_cap,
        q.stride(0), q.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o.stride(0), o.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=num_q_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        BLOCK_D=block_dim(head_dim),
        BLOCK_DV=block_dim(head_dim_v),
        DOT_PRECISION=dot_precision(q.dtype), HAS_WINDOW=sliding_window > 0, HAS_CAP=logit_cap > 0,
        num_warps=warps, num_stages=1,
    )
    return o


def extend_attention_ref(q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                         sliding_window: int = 0, logit_cap: float = 0.0) -> torch.Tensor:
    """Plain per-row torch, in float32: the definition the kernel must match."""
    group = q.shape[1] // k_extend.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v_extend.shape[2], dtype=torch.float32, device=q.device)
    for i in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        slots = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        k = torch.cat([k_buffer[slots], k_extend[q0:q1]]).float().repeat_interleave(group, dim=1)
        v = torch.cat([v_buffer[slots], v_extend[q0:q1]]).float().repeat_interleave(group, dim=1)
        n, pre = q1 - q0, slots.numel()
        scores = torch.einsum("thd,lhd->htl", q[q0:q1].float(), k) * sm_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        key_pos = torch.arange(pre + n, device=q.device)[None, :]
        query_pos = pre + torch.arange(n, device=q.device)[:, None]
        visible = key_pos <= query_pos
        if sliding_window > 0:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out.to(q.dtype)
