"""GGUF blocks -> float32 in torch, vectorised over all blocks at once:
where the native op cannot build, and the reference its tests use beside
gguf-py. Equal to gguf-py's `gguf.quants.dequantize` bit for bit: the same
float32 operations in the same order (each multiply and add its own torch op,
so rounded apart as numpy rounds them; fp16 scales widened exactly)."""

from __future__ import annotations

import torch

from model_proc.quant.ggml_types import GGMLType, block_shape, ggml_type, row_bytes


def check_blocks(blocks: torch.Tensor, qtype: int, k: int) -> GGMLType:
    """`qtype` as a GGMLType, after checking that `blocks` holds a weight of
    `k` columns of it: uint8 [N, row_bytes]; ValueError naming what is wrong."""
    qtype = ggml_type(qtype)
    need = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"blocks must be a uint8 tensor [N, row_bytes], got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[1] != need:
        raise ValueError(f"blocks have {blocks.shape[1]} bytes a row; k = {k} of {qtype.name} needs {need}")
    return qtype


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes (little-endian fp16) -> float32 [..., 1], exactly."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor, dim: int) -> torch.Tensor:
    """The low nibbles of q, then its high ones, stacked at `dim` (a new axis)."""
    return torch.stack([q & 15, q >> 4], dim=dim)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's and Q5_1's qh [..., 4] (a little-endian uint32) -> [..., 32]
    whose element i is bit i of it moved to bit 4: weight i's fifth bit, to or
    into its nibble."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return (((qh.unsqueeze(-1) >> shifts) & 1) << 4).flatten(-2)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-quants' 8 six-bit scales and mins from their 12 packed bytes [..., 12]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def dequantize_torch(blocks: torch.Tensor, qtype: GGMLType, k: int) -> torch.Tensor:
    """float32 [N, k] from a weight's blocks uint8 [N, row_bytes] of `qtype`."""
    qtype = check_blocks(blocks, qtype, k)
    weights, nbytes = block_shape(qtype)
    n = blocks.shape[0]
    b = blocks.reshape(n, k // weights, nbytes)  # [N, blocks, bytes]
    if qtype is GGMLType.Q4_0:
        d, q = _f16(b[..., 0:2]), _nibbles(b[..., 2:], -2).flatten(-2)
        y = d * (q.to(torch.int8) - 8).float()
    elif qtype is GGMLType.Q4_1:
        d, m, q = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:], -2).flatten(-2)
        y = d * q.float() + m
    elif qtype in (GGMLType.Q5_0, GGMLType.Q5_1):  # weights 0-15: low nibbles, 16-31: high
        h = 2 if qtype is GGMLType.Q5_0 else 4  # where qh lies (after d, Q5_1's m); the nibbles follow it
        q = _nibbles(b[..., h + 4:], -2).flatten(-2) | _fifth_bits(b[..., h:h + 4])
        d = _f16(b[..., 0:2])
        if qtype is GGMLType.Q5_0:
            y = d * (q.to(torch.int8) - 16).float()
        else:
            y = d * q.float() + _f16(b[..., 2:4])
    elif qtype is GGMLType.Q8_0:
        y = b[..., 2:].view(torch.int8).float() * _f16(b[..., 0:2])
    elif qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        scale = (d * sc.float()).unsqueeze(-1)  # [N, blocks, 8, 1]
        low = (dmin * mn.float()).unsqueeze(-1)
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # sub-block 2j: low nibbles of qs[j], 2j + 1: high
        q = _nibbles(qs, -2).reshape(n, -1, 8, 32)
        if qtype is GGMLType.Q5_K:  # sub-block j's fifth bits: bit j of the 32 bytes qh
            shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
            q = q | (((b[..., 16:48].unsqueeze(-2) >> shifts) & 1) << 4)
        y = scale * q.float() - low
    elif qtype is GGMLType.Q6_K:
        scale = (_f16(b[..., 208:210]) * b[..., 192:208].view(torch.int8).float()).unsqueeze(-1)  # [N, blocks, 16, 1]
        # 32 weights c = 4h + s: nibbles (s >> 1) of ql[64h + 32(s & 1) ...], bits 2s of qh[32h ...]
        ql = _nibbles(b[..., 0:128].reshape(n, -1, 2, 64), -2).reshape(n, -1, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        qh = ((b[..., 128:192].reshape(n, -1, 2, 1, 32) >> shifts) & 3).reshape(n, -1, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, -1, 16, 16)
        y = scale * q.float()
    else:  # pragma: no cover - GGMLType holds the supported types only
        raise AssertionError(qtype)
    return y.reshape(n, k)
