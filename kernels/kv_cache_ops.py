"""KV-pool bookkeeping on the device: write new K/V into their slots, and
flatten `req_to_token` rows into `kv_indptr`/`kv_indices`.

Both run once per step (indices) or once per layer (store) and are pure
memory movement, so they are tiled for bandwidth: whole [tokens, heads*dim]
tiles per program, no per-element index math beyond a div/mod.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STORE_TILE = 4096  # elements of K (and of V) per store program
INDEX_BLOCK = 1024  # req_to_token entries per inner step


@triton.jit
def _store_kv_kernel(
    K, V, K_Buffer, V_Buffer, loc, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_r = tl.arange(0, BLOCK_R)  # one token's heads * head_dim, flattened
    mask = mask_t[:, None] & (offs_r < ROW)[None, :]
    head = offs_r // HEAD_DIM
    dim = offs_r % HEAD_DIM
    slot = tl.load(loc + offs_t, mask=mask_t, other=0).to(tl.int64)
    src_t = offs_t.to(tl.int64)[:, None]
    k = tl.load(K + src_t * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    tl.store(K_Buffer + slot[:, None] * stride_kbt + (head * stride_kbh + dim)[None, :], k, mask=mask)
    v = tl.load(V + src_t * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    tl.store(V_Buffer + slot[:, None] * stride_vbt + (head * stride_vbh + dim)[None, :], v, mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buffer[loc[t]] = k[t], v_buffer[loc[t]] = v[t]; k/v [T, Hkv, D] may be
    strided views (slices of a fused qkv output) as long as D is contiguous."""
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and k_buffer.shape[1:] == k.shape[1:], "K/V shapes differ from the pool's"
    for t in (k, v, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    if num_tokens == 0:
        return
    block_r = triton.next_power_of_2(num_heads * head_dim)
    block_t = max(1, STORE_TILE // block_r)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_buffer, v_buffer, loc, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        HEAD_DIM=head_dim, ROW=num_heads * head_dim, BLOCK_T=block_t, BLOCK_R=block_r, num_warps=4,
    )


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    k_buffer[loc.long()] = k
    v_buffer[loc.long()] = v


@triton.jit
def _build_kv_indices_kernel(req_to_token, req_pool_indices, kv_indptr, kv_indices, stride_row,
                             BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    out = tl.load(kv_indptr + i)
    length = tl.load(kv_indptr + i + 1) - out
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < length
        slot = tl.load(req_to_token + row * stride_row + offs, mask=mask)
        tl.store(kv_indices + out + offs, slot, mask=mask)  # widened to kv_indices' dtype


def build_kv_indptr(lens: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B+1] int64 offsets, on the lengths' device."""
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=indptr[1:])
    return indptr


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """kv_indices[kv_indptr[i]:kv_indptr[i+1]] = req_to_token[req_pool_indices[i], :len_i]
    as int64; `total` = kv_indptr[-1], passed in so that no device sync is needed."""
    assert req_to_token.stride(1) == 1
    kv_indices = torch.empty(total, dtype=torch.int64, device=req_to_token.device)
    batch = req_pool_indices.numel()
    if batch and total:
        _build_kv_indices_kernel[(batch,)](
            req_to_token, req_pool_indices, kv_indptr, kv_indices, req_to_token.stride(0),
            BLOCK=INDEX_BLOCK, num_warps=4)
    return kv_indices


def build_kv_indices_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         kv_indptr: torch.Tensor) -> torch.Tensor:
    lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    parts = [req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), lens)]
    return torch.cat(parts).long() if parts else torch.empty(0, dtype=torch.int64)
