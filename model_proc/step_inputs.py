"""StepInputs: what one step reads on the device, built once per step from
its ForwardBatch.

The batch's lists become tensors here and nowhere else: the per-row and
per-token lists go into one int64 and one float32 staging buffer, each
filled from one `array` and copied once (through pinned memory to the
device on a GPU), and the step's tensors are views of those buffers or are
derived from them on the device. (Seeds and sample steps stay host lists:
the sampler seeds a generator per seeded row from them.) The attention
backends' metadata, the sampler and the penalties read a StepInputs; the
buffers are allocated once (grown if a step ever needs more) and reused, so
a step's tensors live at the same addresses each time, as graph replay
needs. Rare per-step extras (grammar bitmasks, prompt-logprob targets,
penalty state rebuilds) still turn their own lists into tensors.

A StepInputs is valid until the next one is built from the same builder.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from functools import cached_property

import torch

from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode
from model_proc.sampler import SamplingBatch, per_token


@dataclass(eq=False)
class StepInputs:
    """One step's inputs (B rows, T new tokens). All index tensors are int64.

    Host copies (`*_host`) are the batch's own lists, for the few loops and
    sizes that must not wait for the device."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    # DECODE: every row; MIXED: the last rows, each decoding one token; EXTEND: 0
    decode_rows: int
    req_pool_indices: torch.Tensor  # [B] each row's req_to_token row
    seq_lens: torch.Tensor  # [B] after the step
    prefix_lens: torch.Tensor  # [B] tokens already in the pool (DECODE: seq_lens - 1)
    input_ids: torch.Tensor  # [T] FUTURE_TOKEN resolved
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] the req_to_token row of each new token
    out_cache_loc: torch.Tensor  # [T] the KV slot of each new token
    qo_indptr: torch.Tensor  # [B+1] row i's new tokens are [qo_indptr[i], qo_indptr[i+1])
    kv_indptr: torch.Tensor  # [B+1] row i's whole KV is kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    table: torch.Tensor  # req_to_token, which kv_indices reads
    seq_lens_host: list[int]
    prefix_lens_host: list[int]  # EXTEND and MIXED only ([] in DECODE)
    sampling: SamplingBatch | None = None
    penalty_rows: torch.Tensor | None = None  # [P] ForwardBatch.penalty_rows
    # flat token indices of the prompt positions whose logits rows asked for
    input_logprob_index: torch.Tensor | None = None
    # ForwardBatch.table_rows/table_lens/table_slots (None: no row rewritten)
    table_rewrite: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @cached_property
    def total_kv(self) -> int:
        return sum(self.seq_lens_host)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @cached_property
    def extend_lens_host(self) -> list[int]:
        if self.is_decode:
            return [1] * self.batch_size
        return [s - p for s, p in zip(self.seq_lens_host, self.prefix_lens_host)]

    @cached_property
    def kv_indices(self) -> torch.Tensor:
        """[sum seq_lens] the slots of every row's KV (prefix + new), row after
        row, read from req_to_token on first use: after the runner wrote this
        step's slots, and only by a backend that needs them in this form (the
        Triton backend builds them with its kernel and sets them)."""
        return gather_kv_indices(self.table, self.req_pool_indices, self.seq_lens, self.kv_indptr, self.total_kv)

    def as_token_rows(self) -> StepInputs:
        """Each new token as a decode row of its own: the token at position p
        of table row r attends to r's slots 0..p. A verify step's few tokens
        per row through a decode kernel (the ops store every new token's K/V
        before any row attends, so a draft sees the tokens before it)."""
        n = self.num_tokens
        seq_lens = self.positions + 1
        kv_indptr = torch.zeros(n + 1, dtype=torch.int64, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=kv_indptr[1:])
        seq_lens_host = [p + j + 1 for p, s in zip(self.prefix_lens_host, self.seq_lens_host) for j in range(s - p)]
        return StepInputs(
            ForwardMode.DECODE, n, n, n, self.token_rows, seq_lens, self.positions, self.input_ids, self.positions,
            self.token_rows, self.out_cache_loc, torch.arange(n + 1, device=seq_lens.device), kv_indptr, self.table,
            seq_lens_host, [])

    def split(self, first: int) -> tuple[StepInputs | None, StepInputs]:
        """A MIXED step as its extend rows (0..first-1; None when there are
        none) and its decoding rows (first..), each with its own indptrs
        (sliced, rebased); their kv_indices are slices of this step's. No
        sampling fields."""
        assert self.mode is ForwardMode.MIXED and 0 <= first < self.batch_size
        t = sum(self.extend_lens_host[:first])
        kv = sum(self.seq_lens_host[:first])
        kv_indices = self.kv_indices
        extend = None
        if first:
            extend = StepInputs(
                ForwardMode.EXTEND, first, t, 0, self.req_pool_indices[:first], self.seq_lens[:first],
                self.prefix_lens[:first], self.input_ids[:t], self.positions[:t], self.token_rows[:t],
                self.out_cache_loc[:t], self.qo_indptr[:first + 1], self.kv_indptr[:first + 1], self.table,
                self.seq_lens_host[:first], self.prefix_lens_host[:first])
            extend.kv_indices = kv_indices[:kv]
        n = self.batch_size - first
        decode = StepInputs(
            ForwardMode.DECODE, n, self.num_tokens - t, n, self.req_pool_indices[first:], self.seq_lens[first:],
            self.prefix_lens[first:], self.input_ids[t:], self.positions[t:], self.token_rows[t:],
            self.out_cache_loc[t:], self.qo_indptr[first:] - t, self.kv_indptr[first:] - kv, self.table,
            self.seq_lens_host[first:], [])
        decode.kv_indices = kv_indices[kv:]
        return extend, decode


def gather_kv_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                      kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenate table[rows[i], :seq_lens[i]] over rows, without a Python loop."""
    row_of = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), seq_lens,
                                     output_size=total)
    col = torch.arange(total, device=rows.device) - kv_indptr[:-1][row_of]
    return table[rows[row_of], col].to(torch.int64)


class Staging:
    """A preallocated buffer the step's lists are copied into (pinned host
    memory and its device twin on a GPU), grown when a step needs more."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int) -> None:
        self.dtype, self.device = dtype, device
        self._allocate(capacity)

    @torch.inference_mode(False)  # a buffer grown during a step is still writable outside one
    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        on_host = self.device.type == "cpu"
        self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=not on_host)
        self.dev = self.host if on_host else torch.empty(capacity, dtype=self.dtype, device=self.device)
        # the last copy to the device: the host buffer is not rewritten before it is done
        self.copied = None if on_host else torch.cuda.Event()

    def load(self, values: array.array) -> torch.Tensor:
        """The values on the device: a view of the buffer's first len(values)."""
        n = len(values)
        if n > self.capacity:
            self._allocate(max(n, 2 * self.capacity))
        if self.copied is not None:
            self.copied.synchronize()
        self.host[:n].copy_(torch.frombuffer(values, dtype=self.dtype))
        if self.copied is not None:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self.copied.record()
        return self.dev[:n]


class StepInputBuilder:
    """Builds each step's StepInputs into buffers it keeps (sized for `rows`
    rows and `tokens` new tokens a step; grown on demand)."""

    def __init__(self, table: torch.Tensor, last_sampled: torch.Tensor, rows: int, tokens: int) -> None:
        """table: req_to_token; last_sampled: per table row, the token it sampled
        last (what a decoding row's FUTURE_TOKEN stands for)."""
        self.table = table
        self.last_sampled = last_sampled
        device = self.device = table.device
        self.ints = Staging(torch.int64, device, 5 * rows + 2 * tokens)
        self.floats = Staging(torch.float32, device, 3 * rows)
        self._grow_rows(rows)

    @torch.inference_mode(False)
    def _grow_rows(self, rows: int) -> None:
        self.rows = rows
        self.arange = torch.arange(rows + 1, dtype=torch.int64, device=self.device)  # decode's qo_indptr
        self.qo_indptr = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)
        self.kv_indptr = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)

    def build(self, b: ForwardBatch) -> StepInputs:
        """The step's inputs, from a batch the runner checked (check_batch)."""
        mode = ForwardMode(b.forward_mode)
        bs, num_tokens = len(b.req_pool_indices), len(b.input_ids)
        if bs > self.rows:
            self._grow_rows(max(bs, 2 * self.rows))
        decode = mode is ForwardMode.DECODE
        decode_rows = bs if decode else b.decode_rows if mode is ForwardMode.MIXED else 0
        index = _input_logprob_index(b)
        # the sampled rows' parameters: one set per row, or per token (VERIFY)
        temperatures, top_ps, top_ks_host, min_ps, seeds, steps = \
            b.temperatures, b.top_ps, b.top_ks, b.min_ps, b.seeds, b.sample_steps
        if mode is ForwardMode.VERIFY:
            lens = [s - p for s, p in zip(b.seq_lens, b.prefix_lens)]
            temperatures, top_ps, top_ks_host, min_ps, seeds = (
                per_token(x, lens) for x in (temperatures, top_ps, top_ks_host, min_ps, seeds))
            steps = [s + j for s, n in zip(steps, lens) for j in range(n)]
        ns = len(temperatures)
        ints = array.array("q", b.req_pool_indices)
        ints.extend(b.seq_lens)
        if not decode:
            ints.extend(b.prefix_lens)
        for part in (top_ks_host, b.input_ids, b.out_cache_loc, b.penalty_rows, index, b.table_rows, b.table_lens,
                     b.table_slots):
            ints.extend(part)
        floats = array.array("f", temperatures)
        floats.extend(top_ps)
        floats.extend(min_ps)
        i, f = self.ints.load(ints), self.floats.load(floats)

        rows, seq_lens = i[:bs], i[bs:2 * bs]
        at = 2 * bs
        if not decode:
            prefix_lens, at = i[at:at + bs], at + bs
        top_ks, at = i[at:at + ns], at + ns
        input_ids, at = i[at:at + num_tokens], at + num_tokens
        out_cache_loc, at = i[at:at + num_tokens], at + num_tokens
        penalty_rows, at = i[at:at + len(b.penalty_rows)], at + len(b.penalty_rows)
        input_logprob_index, at = i[at:at + len(index)] if index else None, at + len(index)
        table_rewrite = None
        if b.table_rows:
            n, m = len(b.table_rows), len(b.table_slots)
            table_rewrite = (i[at:at + n], i[at + n:at + 2 * n], i[at + 2 * n:at + 2 * n + m])

        if decode_rows and FUTURE_TOKEN in b.input_ids[num_tokens - decode_rows:]:
            # a decoding row's token still in flight in the scheduler (overlap)
            tail = input_ids[num_tokens - decode_rows:]
            tail.copy_(torch.where(tail == FUTURE_TOKEN, self.last_sampled[rows[bs - decode_rows:]], tail))

        kv_indptr = self.kv_indptr[:bs + 1]
        torch.cumsum(seq_lens, 0, out=kv_indptr[1:])
        if decode:
            positions = prefix_lens = seq_lens - 1
            token_rows, qo_indptr = rows, self.arange[:bs + 1]
        else:
            extend_lens = seq_lens - prefix_lens
            qo_indptr = self.qo_indptr[:bs + 1]
            torch.cumsum(extend_lens, 0, out=qo_indptr[1:])
            row_of = torch.repeat_interleave(self.arange[:bs], extend_lens, output_size=num_tokens)
            positions = torch.arange(num_tokens, device=self.device) - (qo_indptr[:-1] - prefix_lens)[row_of]
            token_rows = rows[row_of]
        sampling = SamplingBatch.from_lists(temperatures, top_ps, top_ks_host, min_ps, seeds, steps,
                                            tensors=(f[:ns], f[ns:2 * ns], top_ks, f[2 * ns:3 * ns]))
        return StepInputs(
            mode, bs, num_tokens, decode_rows, rows, seq_lens, prefix_lens, input_ids, positions, token_rows,
            out_cache_loc, qo_indptr, kv_indptr, self.table, b.seq_lens, b.prefix_lens, sampling,
            penalty_rows if b.penalty_rows else None, input_logprob_index, table_rewrite)


def build_step_inputs(batch: ForwardBatch, table: torch.Tensor) -> StepInputs:
    """One batch's inputs in buffers of their own (tests and benchmarks that
    drive a backend without a runner; FUTURE_TOKEN is not resolved)."""
    last_sampled = torch.zeros(table.shape[0], dtype=torch.int64, device=table.device)
    return StepInputBuilder(table, last_sampled, len(batch.req_pool_indices), len(batch.input_ids)).build(batch)


def _input_logprob_index(b: ForwardBatch) -> list[int]:
    """Flat token indices of the prompt positions whose logits rows asked for."""
    if not b.input_logprob_rows:
        return []
    first, offset = [], 0
    for p, s in zip(b.prefix_lens, b.seq_lens):
        first.append(offset)
        offset += s - p
    return [first[r] + st + j for r, st, ts in zip(b.input_logprob_rows, b.input_logprob_starts,
                                                   b.input_logprob_targets) for j in range(len(ts))]
