"""The torch backend: attention with torch ops only, on any device (the
CPU's where the native op is not built)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collections.abc import Sequence

from model_proc.attention.base import AttentionBackend, AttentionMetadata, LayerAttention
from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.step_inputs import StepInputs


@dataclass
class TorchAttnMetadata(AttentionMetadata):
    # extend: host copies for the per-row loop: each row's new tokens in q, and
    # the part of kv_indices holding its prefix's slots (empty: no prefix)
    qo_bounds: list[tuple[int, int]] | None = None
    prefix_bounds: list[tuple[int, int]] | None = None
    # decode: a padded [B, max_len] slot matrix (padding -> dummy slot 0) and
    # the [B, 1, 1, max_len] mask of real entries, built once, used per layer
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    max_len: int = 0
    # decode: per window a layer uses, the same for each row's last `window`
    # slots only ([B, min(max_len, window)]): no key outside it is read
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


class GatherWorkspace:
    """Reused destination of the page gathers: a decode step's rows, an
    extend row's prefix.

    A fresh [rows * max_len, kv_heads, D] tensor per layer is a new large
    allocation each time, and on CPU its first touch page-faults: far slower
    than `index_select(out=)` into memory already mapped (bench/RESULTS.md,
    "Decode step: attention share (torch backend)"). So one K and one V buffer live
    as long as the backend, grown when a step needs more; every layer and
    every step writes into them. Decode chunking bounds their size (about
    `decode_chunk_bytes`, or one row if a row is bigger); an extend needs its
    longest prefix (at most the context length).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def get(self, rows: int, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of `rows` rows of the pool's heads, in its compute dtype."""
        # an inference-mode tensor cannot be written outside inference mode
        stale = self.k is not None and self.k.is_inference() and not torch.is_inference_mode_enabled()
        if self.k is None or stale or self.k.shape[0] < rows or self.k.dtype != pool.dtype:
            like = pool.k_buffer[0]
            shape = (rows, *like.shape[1:])
            self.k = torch.empty(shape, dtype=pool.dtype, device=like.device)
            self.v = torch.empty(shape, dtype=pool.dtype, device=like.device)
        assert self.v is not None
        return self.k[:rows], self.v[:rows]


class TorchAttnBackend(AttentionBackend):
    """CPU (or any device) attention with torch ops only.

    Decode has no per-request loop: the step's padded slot matrix and mask
    are built once (init_forward_metadata); each layer gathers its pages into
    the reused workspace and runs one padded, masked SDPA per chunk of rows
    (the whole batch unless it is big). Gathering every layer's pages once per
    step instead would move the same bytes (each layer's pages differ) and
    hold num_layers times the workspace; measured no faster.
    """

    # K + V gathered per SDPA call. A big batch goes in chunks of rows that
    # stay in the last-level cache from the gather until SDPA reads them:
    # less attention time than one batch-wide gather (bench/RESULTS.md,
    # "Decode step: attention share (torch backend)"). A chunk is never less
    # than one row.
    decode_chunk_bytes = 8 << 20

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenTable, scale: float,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        super().__init__(kv_pool, req_to_token, scale, layers)
        self.workspace = GatherWorkspace()
        self.windows = sorted({spec.window for spec in self.layers if spec.window is not None})

    def init_forward_metadata(self, inputs: StepInputs) -> TorchAttnMetadata:
        if inputs.is_decode:
            max_len = inputs.max_seq_len
            cols = torch.arange(max_len, device=inputs.seq_lens.device)
            valid = cols[None, :] < inputs.seq_lens[:, None]
            table = self.req_to_token.table
            slots = table[inputs.req_pool_indices, :max_len].to(torch.int64).masked_fill_(~valid, 0)
            windows = {}
            for w in self.windows:
                # a sliding layer's decode token at position s - 1 sees s - window .. s - 1
                first = (inputs.seq_lens - w).clamp(min=0)
                pos = first[:, None] + cols[None, :min(max_len, w)]
                seen = pos < inputs.seq_lens[:, None]
                w_slots = torch.gather(table[inputs.req_pool_indices], 1, pos.masked_fill(~seen, 0))
                windows[w] = (w_slots.to(torch.int64).masked_fill_(~seen, 0).flatten(), seen[:, None, None, :])
            return TorchAttnMetadata(inputs, decode_slots=slots.flatten(), decode_mask=valid[:, None, None, :],
                                     max_len=max_len, decode_windows=windows)
        # EXTEND, and MIXED (its decoding rows are extend rows of one token here)
        inputs.kv_indices  # gathered here, once per step, rather than by the first layer
        qo_bounds, prefix_bounds = [], []
        q0 = k0 = 0
        for s, p in zip(inputs.seq_lens_host, inputs.prefix_lens_host):
            qo_bounds.append((q0, q0 + s - p))
            prefix_bounds.append((k0, k0 + p))
            q0, k0 = q0 + s - p, k0 + s
        return TorchAttnMetadata(inputs, qo_bounds=qo_bounds, prefix_bounds=prefix_bounds)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        self.kv_pool.store(layer_id, self.layer_slots(meta, layer_id, "out", meta.out_cache_loc), k, v)
        if meta.is_decode:
            return self._decode(q, layer_id, meta)
        return self._extend(q, k, v, layer_id, meta)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: TorchAttnMetadata) -> torch.Tensor:
        spec = self.layers[layer_id]
        if spec.window is None:
            slots, mask = meta.decode_slots, meta.decode_mask
        else:
            slots, mask = meta.decode_windows[spec.window]
            slots = self.layer_slots(meta, layer_id, f"decode{spec.window}", slots)
        max_len = mask.shape[-1]
        k_buf = self.kv_pool.k_buffer[layer_id]
        row_bytes = 2 * max_len * k_buf[0].numel() * self.kv_pool.dtype.itemsize  # one row's K + V, padded
        chunk = max(1, min(meta.batch_size, self.decode_chunk_bytes // row_bytes))
        k_ws, v_ws = self.workspace.get(chunk * max_len, self.kv_pool)
        if chunk == meta.batch_size:
            return self._decode_rows(q, layer_id, slots, mask, k_ws, v_ws, spec.softcap)
        out = torch.empty_like(q)
        for r0 in range(0, meta.batch_size, chunk):
            r1 = min(r0 + chunk, meta.batch_size)
            out[r0:r1] = self._decode_rows(q[r0:r1], layer_id, slots[r0 * max_len:r1 * max_len],
                                           mask[r0:r1], k_ws, v_ws, spec.softcap)
        return out

    def _decode_rows(self, q: torch.Tensor, layer_id: int, slots: torch.Tensor,
                     mask: torch.Tensor, k_ws: torch.Tensor, v_ws: torch.Tensor,
                     softcap: float | None = None) -> torch.Tensor:
        """One padded, masked SDPA over rows whose flattened [rows * max_len]
        slots are given, gathered into the workspace."""
        rows, max_len = mask.shape[0], mask.shape[-1]
        k_ws, v_ws = k_ws[:slots.numel()], v_ws[:slots.numel()]
        self.kv_pool.gather(layer_id, slots, k_ws, v_ws)
        # [rows, max_len, kv_heads, D] -> [rows, kv_heads, max_len, D]
        kv_heads, head_dim = k_ws.shape[1:]
        k = k_ws.view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        v = v_ws.view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        # The query heads that share a KV head (GQA) go in as that head's
        # "query positions": one [group, max_len] score matrix per KV head, K
        # and V read once, never expanded; no causal mask applies to a decode
        # token. Faster than SDPA's enable_gqa.
        group = q.shape[1] // kv_heads
        q = q.view(rows, kv_heads, group, head_dim)
        if softcap is not None:  # SDPA has no soft-cap: the scores in float32 matmuls
            out = capped_attention(q, k, v, mask, self.scale, softcap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(rows, kv_heads * group, head_dim)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: TorchAttnMetadata) -> torch.Tensor:
        """Each row's new tokens attend to its prefix in the pool and,
        causally, to themselves.

        With a prefix, the causal mask of the new tokens over prefix + new is
        bottom-right aligned, which SDPA's CPU flash kernel cannot take as
        `is_causal` (top-left only); as an explicit mask it costs a mask read
        per score and a bool -> float conversion per layer. So the two parts
        go separately: the queries over the whole prefix with no mask, and
        over the new tokens with a plain (square) causal mask; the two partial
        results are merged by their log-sum-exp (merge_attention). The prefix
        K/V are gathered into the reused workspace (`index_select(out=)`).
        Measured against the masked SDPA it replaced by
        `python -m bench.micro.prefill_bench --before` (bench/RESULTS.md,
        "Prefill over a cached prefix").
        """
        spec = self.layers[layer_id]
        if spec.window is not None or spec.softcap is not None:
            return self._extend_masked(q, k, v, layer_id, spec, meta,
                                       self.layer_slots(meta, layer_id, "kv", meta.kv_indices))
        out = torch.empty_like(q)
        for (q0, q1), (p0, p1) in zip(meta.qo_bounds, meta.prefix_bounds):
            # [1, heads, tokens, D]: the CPU flash kernel takes 4-d inputs only
            # (3-d ones go to the slower math path)
            rq, rk, rv = (x[None, q0:q1].transpose(1, 2) for x in (q, k, v))
            if p1 == p0:  # no prefix: the new tokens are the whole row
                o = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                pk, pv = self.workspace.get(p1 - p0, self.kv_pool)
                self.kv_pool.gather(layer_id, meta.kv_indices[p0:p1], pk, pv)
                over_prefix = attention_with_lse(rq, pk[None].transpose(1, 2), pv[None].transpose(1, 2),
                                                 False, self.scale)
                over_new = attention_with_lse(rq, rk, rv, True, self.scale)
                o = merge_attention(*over_prefix, *over_new)
            out[q0:q1] = o[0].transpose(0, 1)
        return out

    def _extend_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       spec: LayerAttention, meta: TorchAttnMetadata, kv_indices: torch.Tensor) -> torch.Tensor:
        """Extend for a sliding or soft-capped layer: per row, the queries
        over the part of the prefix any of them can still see (a window's
        worth at most) and the new tokens, with an explicit mask of who sees
        what, in float32 matmuls (capped_attention), queries in blocks so
        the score matrix stays small."""
        out = torch.empty_like(q)
        kv_heads, head_dim = k.shape[1:]
        group = q.shape[1] // kv_heads
        cap = spec.softcap
        for (q0, q1), (p0, p1) in zip(meta.qo_bounds, meta.prefix_bounds):
            prefix = p1 - p0
            # the first new token (position `prefix`) sees keys from prefix - window + 1 on
            first = 0 if spec.window is None else max(0, prefix - spec.window + 1)
            slots = kv_indices[p0 + first:p1]
            pk, pv = (k.new_empty((slots.numel(), kv_heads, head_dim)) for _ in range(2))
            self.kv_pool.gather(layer_id, slots, pk, pv)
            rk = torch.cat([pk, k[q0:q1]]).transpose(0, 1)  # [kv_heads, L, D]
            rv = torch.cat([pv, v[q0:q1]]).transpose(0, 1)
            kpos = torch.arange(first, prefix + q1 - q0, device=q.device)
            for b0 in range(q0, q1, self.masked_query_block):
                b1 = min(q1, b0 + self.masked_query_block)
                qpos = torch.arange(prefix + b0 - q0, prefix + b1 - q0, device=q.device)
                seen = kpos[None, :] <= qpos[:, None]
                if spec.window is not None:
                    seen &= kpos[None, :] > qpos[:, None] - spec.window
                # [kv_heads, group, n, D]: the query heads sharing a KV head together
                rq = q[b0:b1].view(b1 - b0, kv_heads, group, head_dim).permute(1, 2, 0, 3)
                o = capped_attention(rq, rk[:, None], rv[:, None], seen, self.scale, cap)
                out[b0:b1] = o.permute(2, 0, 1, 3).reshape(b1 - b0, kv_heads * group, head_dim)
        return out

    # queries per score matrix in _extend_masked ([heads, block, keys] float32)
    masked_query_block = 256


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """softmax(cap(q.k * scale) masked) @ v in float32, as transformers'
    eager attention with its soft-cap (Gemma 2) and a boolean mask (True:
    seen); q [..., n, D], k/v [..., L, D] and mask [..., n, L] broadcast.
    Returns q's dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.masked_fill_(~mask, float("-inf")).softmax(-1)
    return torch.matmul(scores, v.float()).to(q.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hq, n, D] over k, v [B, Hkv, L, D] (GQA: Hq a
    multiple of Hkv), and each query's log-sum-exp of its scaled scores
    [B, Hq, n] (float32). `causal`: top-left aligned (query i sees keys 0..i).

    On a CPU: the flash kernel SDPA itself dispatches to, which returns the
    log-sum-exp beside the output (public SDPA does not). Elsewhere (the torch
    backend on a GPU): attention_with_lse_matmul."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return attention_with_lse_matmul(q, k, v, causal, scale)


def attention_with_lse_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse in plain float32 matmuls (the whole score matrix)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        n, length = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n, length, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp_() @ v).to(q.dtype), lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's
    output [B, H, n, D] and log-sum-exp [B, H, n]: the outputs weighted by
    each set's share of the softmax mass, exp(lse_a) / (exp(lse_a) +
    exp(lse_b)) = sigmoid(lse_a - lse_b) for set a. In float32; returns o_a's
    dtype."""
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(o_b.float(), o_a.float(), share_a).to(o_a.dtype)
