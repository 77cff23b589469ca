"""The batch-invariant attention backend of `--deterministic` (the mode as a
whole: model_proc/row_blocks.py): each query walks its keys in tiles of
`KV_BLOCK`, in key order, with matmuls of one shape per tile, so its result
depends on its own keys only, the same in decode and in extend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_proc.attention.base import AttentionBackend, AttentionMetadata
from model_proc.step_inputs import StepInputs

# Keys per attention tile. A multiple of 32 floats: exp's input is then whole
# vectors (and so is each thread's half of it), so no element of a query's
# weights goes through the scalar tail loop in one batch and not in another.
KV_BLOCK = 64
# Extend: a row's queries go in chunks of this many, each over the key tiles
# it can see only (the causal upper triangle is skipped).
QUERY_CHUNK = 4 * KV_BLOCK


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, never with a batch of one (which can take another kernel)."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    return torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]


def _gather_tiles(buf: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """Decode: the K or V of tile-major slots as n = tiles * rows * kv_heads
    matrices [KV_BLOCK, D], each contiguous, ordered (tile, row, KV head).
    (One gather and a transposing copy: faster here than a gather per head.)"""
    kv_heads, dim = buf.shape[1], buf.shape[2]
    t = buf.index_select(0, slots).view(-1, KV_BLOCK, kv_heads, dim)
    return t.transpose(1, 2).reshape(n, KV_BLOCK, dim)


def tile_weights(scores: torch.Tensor, masked: torch.Tensor, scale: float,
                 tile_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax numerators and denominators over tiles of KV_BLOCK keys.

    scores [..., g, KV_BLOCK]: q . k of queries (g query heads per KV head)
    with each key of each tile, the tiles along `tile_dim` in key order;
    masked broadcasts to it (True: not a key of this query). Returns p (the
    shape of scores) and the denominators (scores' shape without `tile_dim`
    and the last). The max is exact in any order; the sums go tile by tile in
    key order, so a tile wholly masked for a query (a longer batch mate's, or
    the rest of a prompt) adds exact zeros and changes nothing.
    """
    scores.mul_(scale).masked_fill_(masked, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).amax(tile_dim, keepdim=True)
    p = torch.exp(scores - row_max)
    return p, sum_in_key_order(p.sum(-1).unbind(tile_dim))


def sum_in_key_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


@dataclass
class DecodeChunk:
    """Rows r0..r1 of a decode step: their slots tile-major [tiles * rows *
    KV_BLOCK] (past a row's length: the dummy slot 0) and the mask
    [tiles, rows, 1, 1, KV_BLOCK] of those padding entries."""
    r0: int
    r1: int
    slots: torch.Tensor
    masked: torch.Tensor


@dataclass
class ExtendChunk:
    """Queries c0..c1 of a row (relative to the row's first new token), the
    key tiles they can see, and their mask [tiles, c1 - c0, 1, KV_BLOCK]."""
    c0: int
    c1: int
    tiles: int
    masked: torch.Tensor


@dataclass
class BatchInvariantAttnMetadata(AttentionMetadata):
    num_tiles: int = 0  # decode: key tiles of the longest row
    decode_chunks: list[DecodeChunk] | None = None
    # extend, per row: first token in the step's token axis, the row's slots
    # padded to whole tiles, its query chunks
    extend_rows: list[tuple[int, torch.Tensor, list[ExtendChunk]]] | None = None


class BatchInvariantAttnBackend(AttentionBackend):
    """Attention whose per-query computation depends on the query's own keys
    only, the same in decode and in extend (see the module docstring). Torch
    ops, on any device; bit-for-bit invariance is checked on the CPU.

    Every q . k and p . v product is a batched matmul of one shape per query
    and KV head, [g, D] x [D, KV_BLOCK] and [g, KV_BLOCK] x [KV_BLOCK, D] (g
    query heads per KV head), whatever the batch: decode stacks every (tile,
    row, KV head) into one such batch; extend gathers a row's tiles once and shares
    them between its queries (a stride-0 batch), one tile at a time.
    """

    # K + V gathered per decode chunk of rows (as TorchAttnBackend.decode_chunk_bytes:
    # a chunk stays in the cache from the gather to the matmuls)
    decode_chunk_bytes = 8 << 20

    def init_forward_metadata(self, inputs: StepInputs) -> BatchInvariantAttnMetadata:
        table = self.req_to_token.table
        k_buf = self.kv_pool.k_buffer[0]
        bs, rows, seq_lens = inputs.batch_size, inputs.req_pool_indices, inputs.seq_lens
        device = rows.device
        if inputs.is_decode:
            max_len = inputs.max_seq_len
            tiles = -(-max_len // KV_BLOCK)
            cols = torch.arange(tiles * KV_BLOCK, device=device)
            masked = cols[None, :] >= seq_lens[:, None]  # [B, tiles * KV_BLOCK]
            slots = torch.zeros(bs, tiles * KV_BLOCK, dtype=torch.int64, device=device)
            slots[:, :max_len] = table[rows, :max_len]
            slots.masked_fill_(masked, 0)
            slots = slots.view(bs, tiles, KV_BLOCK).transpose(0, 1)  # tile-major
            masked = masked.view(bs, tiles, 1, 1, KV_BLOCK).transpose(0, 1)
            row_bytes = 2 * tiles * KV_BLOCK * k_buf[0].numel() * k_buf.element_size()
            step = max(1, min(bs, self.decode_chunk_bytes // row_bytes))
            chunks = [DecodeChunk(r0, min(bs, r0 + step), slots[:, r0:r0 + step].reshape(-1),
                                  masked[:, r0:r0 + step])
                      for r0 in range(0, bs, step)]
            return BatchInvariantAttnMetadata(inputs, num_tiles=tiles, decode_chunks=chunks)

        # EXTEND, and MIXED (its decoding rows are extend rows of one token here:
        # the same per-query computation as decode)
        extend_rows = []
        q0 = 0
        for row, s, p in zip(rows.tolist(), inputs.seq_lens_host, inputs.prefix_lens_host):
            n = s - p
            row_slots = torch.zeros(-(-s // KV_BLOCK) * KV_BLOCK, dtype=torch.int64, device=device)
            row_slots[:s] = table[row, :s]
            chunks = []
            for c0 in range(0, n, QUERY_CHUNK):
                c1 = min(n, c0 + QUERY_CHUNK)
                # the row's query j sits at position p + j and sees keys 0..p + j
                lens = torch.arange(p + c0 + 1, p + c1 + 1, device=device)
                tiles = -(-(p + c1) // KV_BLOCK)
                cols = torch.arange(tiles * KV_BLOCK, device=device)
                masked = (cols[None, :] >= lens[:, None]).view(c1 - c0, tiles, 1, KV_BLOCK).transpose(0, 1)
                chunks.append(ExtendChunk(c0, c1, tiles, masked))
            extend_rows.append((q0, row_slots, chunks))
            q0 += n
        return BatchInvariantAttnMetadata(inputs, extend_rows=extend_rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: BatchInvariantAttnMetadata) -> torch.Tensor:
        """q/k/v may carry padding rows past the step's tokens (the model pads
        its token axis): they are not stored, and their output is zero."""
        n = meta.out_cache_loc.shape[0]
        self.kv_pool.store(layer_id, meta.out_cache_loc, k[:n], v[:n])
        out = q.new_zeros(q.shape)
        if meta.is_decode:
            self._decode(q, layer_id, meta, out)
        else:
            self._extend(q, layer_id, meta, out)
        return out

    def _decode(self, q: torch.Tensor, layer_id: int, meta: BatchInvariantAttnMetadata,
                out: torch.Tensor) -> None:
        assert meta.decode_chunks is not None
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_buf.shape[1]
        group, tiles = heads // kv_heads, meta.num_tiles
        for c in meta.decode_chunks:
            rows = c.r1 - c.r0
            n = tiles * rows * kv_heads  # matrices, ordered (tile, row, KV head)
            qc = q[c.r0:c.r1].reshape(1, rows * kv_heads, group, dim).expand(tiles, -1, group, dim)
            scores = _bmm(qc.reshape(n, group, dim), _gather_tiles(k_buf, c.slots, n).transpose(1, 2))
            p, denom = tile_weights(scores.view(tiles, rows, kv_heads, group, KV_BLOCK), c.masked,
                                    self.scale, tile_dim=0)
            pv = _bmm(p.view(n, group, KV_BLOCK), _gather_tiles(v_buf, c.slots, n))
            o = sum_in_key_order(pv.view(tiles, rows, kv_heads, group, dim).unbind(0))
            out[c.r0:c.r1] = o.div_(denom[..., None]).view(rows, heads, dim)

    def _extend(self, q: torch.Tensor, layer_id: int, meta: BatchInvariantAttnMetadata,
                out: torch.Tensor) -> None:
        assert meta.extend_rows is not None
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_buf.shape[1]
        group = heads // kv_heads
        for q0, slots, chunks in meta.extend_rows:
            tiles = slots.shape[0] // KV_BLOCK
            # [tiles, kv_heads, KV_BLOCK, D]: each [KV_BLOCK, D] matrix contiguous, as in decode
            keys = k_buf[slots].view(tiles, KV_BLOCK, kv_heads, dim).transpose(1, 2).contiguous()
            values = v_buf[slots].view(tiles, KV_BLOCK, kv_heads, dim).transpose(1, 2).contiguous()
            for c in chunks:
                nq = c.c1 - c.c0
                for h in range(kv_heads):
                    qh = q[q0 + c.c0:q0 + c.c1, h * group:(h + 1) * group]  # [nq, g, D]
                    scores = torch.stack([_bmm(qh, keys[j, h].expand(nq, KV_BLOCK, dim).transpose(1, 2))
                                          for j in range(c.tiles)])
                    p, denom = tile_weights(scores, c.masked, self.scale, tile_dim=0)
                    o = sum_in_key_order([_bmm(p[j], values[j, h].expand(nq, KV_BLOCK, dim))
                                          for j in range(c.tiles)])
                    out[q0 + c.c0:q0 + c.c1, h * group:(h + 1) * group] = o.div_(denom[..., None])
