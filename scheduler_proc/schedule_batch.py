"""ScheduleBatch: the rows the next forward runs on.

The running batch changes only through `filter_batch` (gather the live rows)
and `merge_batch` (concatenate a just-prefilled batch). Per-row sampling state
lives in lists indexed by row, so both are one gather or one concatenation
per field (lists: they go out as lists, and a batch has tens of rows). A
row's lengths are its request's (`Req.kv_len`, written by the CacheManager
alone); `prepare_for_extend` and `prepare_for_decode` have the cache manager
allocate and advance them, and read this step's from the requests.

A mixed step (`--enable-mixed-chunk`, `mix_with_running`) is an extend whose
last rows are the running batch's, each with one new token: its decode step,
run in the same pass over the weights as the prefill.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode, PenaltyInit
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.grammar import fill_bitmask, fill_draft_bitmask, new_bitmask
from scheduler_proc.req import Req
from scheduler_proc.thinking_budget import allow_only

# Per-row lists that filter_batch gathers and merge_batch concatenates.
ROW_FIELDS = ("req_pool_indices", "temperatures", "top_ps", "top_ks", "min_ps", "seeds",
              "top_logprobs_nums")


class OutOfKVSlots(RuntimeError):
    pass


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: ForwardMode = ForwardMode.DECODE
    # one entry per row
    req_pool_indices: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # -1: none
    top_logprobs_nums: list[int] = field(default_factory=list)
    return_logprob: bool = False  # some row wants logprobs
    has_penalties: bool = False  # some row uses penalties (else a step never looks for them)
    has_grammar: bool = False  # some row is constrained by a grammar
    # this step only (valid from prepare_for_* until the step is sent)
    prefix_lens: list[int] = field(default_factory=list)  # each row's kv_len before the step
    seq_lens: list[int] = field(default_factory=list)  # each row's kv_len after it (ForwardBatch.seq_lens)
    decode_from: int = 0  # rows from here on decode one token (all in decode, none in a plain extend)
    draft_lens: list[int] = field(default_factory=list)  # VERIFY: each row's drafts after its last token
    # VERIFY: the grammar rows' tokens (flat indices) and their masks, one per token
    draft_grammar: tuple[list[int], bytes] = ([], b"")
    input_ids: list[int] = field(default_factory=list)
    out_cache_loc: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    # rows whose prefix the cache manager rewrote: the model's table follows
    table_rows: list[int] = field(default_factory=list)
    table_lens: list[int] = field(default_factory=list)
    table_slots: list[int] = field(default_factory=list)
    penalty_inits: list[PenaltyInit] = field(default_factory=list)
    # KV rows the model copies before the step (ForwardBatch.kv_copy_src/dst)
    kv_copy_src: list[int] = field(default_factory=list)
    kv_copy_dst: list[int] = field(default_factory=list)
    window_pages: list[int] = field(default_factory=list)  # ForwardBatch.window_pages
    # prompt logprobs this extend computes (see ForwardBatch)
    input_logprob_rows: list[int] = field(default_factory=list)
    input_logprob_starts: list[int] = field(default_factory=list)
    input_logprob_targets: list[list[int]] = field(default_factory=list)

    @classmethod
    def init_new(cls, reqs: list[Req]) -> "ScheduleBatch":
        sps = [r.sampling_params for r in reqs]
        return cls(
            reqs=list(reqs),
            req_pool_indices=[r.req_pool_idx for r in reqs],
            temperatures=[sp.temperature for sp in sps],
            top_ps=[sp.top_p for sp in sps],
            top_ks=[sp.top_k for sp in sps],
            min_ps=[sp.min_p for sp in sps],
            seeds=[-1 if sp.seed is None else sp.seed for sp in sps],
            top_logprobs_nums=[r.top_logprobs_num for r in reqs],
            return_logprob=any(r.return_logprob for r in reqs),
            has_penalties=any(r.penalized for r in reqs),
            has_grammar=any(r.grammar is not None for r in reqs),
        )

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ---- the two ways a batch changes ------------------------------------------------

    def filter_batch(self, keep_indices: list[int] | None = None) -> None:
        """Keep only the given rows (default: the unfinished ones), in that order."""
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished]
        if len(keep_indices) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.return_logprob = any(r.return_logprob for r in self.reqs)
        self.has_penalties = any(r.penalized for r in self.reqs)
        self.has_grammar = any(r.grammar is not None for r in self.reqs)
        for name in ROW_FIELDS:
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep_indices])

    def merge_batch(self, other: "ScheduleBatch") -> None:
        """Append the rows of `other` (a batch that has just been prefilled)."""
        self.reqs.extend(other.reqs)
        self.return_logprob = self.return_logprob or other.return_logprob
        self.has_penalties = self.has_penalties or other.has_penalties
        self.has_grammar = self.has_grammar or other.has_grammar
        for name in ROW_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    # ---- preparing one step ----------------------------------------------------------

    def prepare_for_extend(self, cache: CacheManager, extend_lens: list[int] | None = None) -> None:
        """Slots for extend_lens[i] tokens of row i after its kv_len (None:
        all its tokens not in the pool yet). Rows were given their table row
        (and their cached prefix) at admission."""
        self.forward_mode = ForwardMode.EXTEND
        self.decode_from = len(self.reqs)
        self.draft_lens = []
        assert all(r.req_pool_idx for r in self.reqs), "extend of a request without a table row"
        self.prefix_lens = [r.kv_len for r in self.reqs]
        if extend_lens is None:
            extend_lens = [r.num_tokens - p for r, p in zip(self.reqs, self.prefix_lens)]
        locs = cache.alloc_extend(self.reqs, extend_lens)
        if locs is None:
            raise OutOfKVSlots(f"cannot allocate {sum(extend_lens)} KV slots")
        self.out_cache_loc = locs
        self.seq_lens = [r.kv_len for r in self.reqs]
        self.input_ids = [t for r, p, n in zip(self.reqs, self.prefix_lens, extend_lens) for t in r.fill_ids[p:p + n]]
        self.collect_table_rewrites(cache)
        self.kv_copy_src, self.kv_copy_dst = cache.take_kv_copies(self.reqs)
        self.window_pages = cache.take_window_pages()
        # a row's penalty state is built from the request's tokens at its first
        # extend since admission (a cached prefix is not recomputed, and a
        # retracted request comes back with its output so far)
        self.penalty_inits = []
        for i, r in enumerate(self.reqs):
            if r.penalized and not r.penalty_state_sent:
                self.penalty_inits.append(r.penalty_init(i))
                r.penalty_state_sent = True
        self.collect_input_logprobs(extend_lens)
        self.req_pool_indices = [r.req_pool_idx for r in self.reqs]

    def collect_input_logprobs(self, extend_lens: list[int]) -> None:
        """The prompt positions this extend computes whose logprobs rows still
        want: each asked for once (input_logprob_next moves past them now)."""
        self.input_logprob_rows, self.input_logprob_starts, self.input_logprob_targets = [], [], []
        for i, (r, p, n) in enumerate(zip(self.reqs, self.prefix_lens, extend_lens)):
            if not r.wants_input_logprobs:
                continue
            # the prefix cache match stops at input_logprob_next (Req.prefix_limit)
            assert p <= r.input_logprob_next, "a wanted prompt position was taken from the cache"
            lo, hi = r.input_logprob_next, min(p + n, len(r.origin_input_ids) - 1)
            if lo >= hi:
                continue
            self.input_logprob_rows.append(i)
            self.input_logprob_starts.append(lo - p)
            self.input_logprob_targets.append(r.origin_input_ids[lo + 1:hi + 1])
            r.input_logprob_next = hi

    def prepare_for_decode(self, cache: CacheManager) -> None:
        """One new token per row: the row's last sampled token, at position kv_len.
        A token still in flight (overlap) goes as FUTURE_TOKEN: the model has it;
        so does the dropped token of a prefill-only row kept as padding (static
        batching), which has no output."""
        self.forward_mode = ForwardMode.DECODE
        self.decode_from = 0
        self.draft_lens = []
        self.prefix_lens = []
        self.penalty_inits = []
        self.kv_copy_src, self.kv_copy_dst = [], []
        self.input_logprob_rows, self.input_logprob_starts, self.input_logprob_targets = [], [], []
        self.collect_table_rewrites(cache)
        locs = cache.alloc_decode(self.reqs)
        if locs is None:
            raise OutOfKVSlots(f"cannot allocate {len(self.reqs)} KV slots for decode")
        self.window_pages = cache.take_window_pages()
        self.out_cache_loc = locs
        self.seq_lens = [r.kv_len for r in self.reqs]
        self.input_ids = [FUTURE_TOKEN if r.pending_tokens or not r.output_ids else r.output_ids[-1]
                          for r in self.reqs]

    def prepare_for_verify(self, cache: CacheManager, drafts: list[list[int]]) -> None:
        """Speculative decoding: each row runs its last sampled token (at
        position kv_len, as in decode) and then its drafts, all sampled in one
        step (ForwardMode.VERIFY). Its kv_len moves past all of them now; the
        result trims it back to what the row keeps (CacheManager.trim). No
        token may be in flight: the drafts follow the last one."""
        assert all(not r.pending_tokens and r.output_ids for r in self.reqs), "verify with a token in flight"
        self.forward_mode = ForwardMode.VERIFY
        self.decode_from = 0
        self.draft_lens = [len(d) for d in drafts]
        self.penalty_inits = []
        self.kv_copy_src, self.kv_copy_dst = [], []
        self.input_logprob_rows, self.input_logprob_starts, self.input_logprob_targets = [], [], []
        self.collect_table_rewrites(cache)
        self.prefix_lens = [r.kv_len for r in self.reqs]
        locs = cache.alloc_tokens(self.reqs, [1 + n for n in self.draft_lens])
        if locs is None:
            raise OutOfKVSlots(f"cannot allocate {len(self.reqs) + sum(self.draft_lens)} KV slots for a verify")
        self.window_pages = cache.take_window_pages()
        self.out_cache_loc = locs
        self.seq_lens = [r.kv_len for r in self.reqs]
        self.input_ids = [t for r, d in zip(self.reqs, drafts) for t in (r.output_ids[-1], *d)]
        # a grammar row's every token is sampled under its own mask (the drafts
        # passed its matcher); a forced thinking tag's row (no drafts) under its one token
        starts = list(itertools.accumulate((1 + n for n in self.draft_lens), initial=0))
        constrained = [i for i, r in enumerate(self.reqs) if not r.finished and (
            r.grammar is not None or (r.thinking is not None and r.thinking.forced_next is not None))]
        self.draft_grammar = ([starts[i] + j for i in constrained for j in range(1 + self.draft_lens[i])],
                              self.draft_bitmask(constrained, drafts))

    def mix_with_running(self, running: "ScheduleBatch") -> None:
        """Append the running batch, prepared for its decode step, as extend
        rows of one new token each (its FUTURE_TOKEN inputs included: the model
        resolves them per row). The step goes out as ForwardMode.MIXED, with
        these rows as its `decode_rows`."""
        assert self.forward_mode is ForwardMode.EXTEND and running.forward_mode is ForwardMode.DECODE
        self.decode_from = len(self.reqs)
        self.prefix_lens = self.prefix_lens + [n - 1 for n in running.seq_lens]
        self.seq_lens = self.seq_lens + running.seq_lens
        self.input_ids = self.input_ids + running.input_ids
        self.out_cache_loc = np.concatenate([self.out_cache_loc, running.out_cache_loc])
        self.table_rows = self.table_rows + running.table_rows
        self.table_lens = self.table_lens + running.table_lens
        self.table_slots = self.table_slots + running.table_slots
        self.window_pages = self.window_pages + running.window_pages
        self.merge_batch(running)

    def keeps_token(self, i: int, seq_len: int) -> bool:
        """Whether row i keeps the token it samples this step (seq_len: its
        kv_len after the step): a decoding row always; an extend row only once
        its whole prompt is in (not after a mid-prompt chunk)."""
        return i >= self.decode_from or seq_len == self.reqs[i].num_tokens

    def collect_table_rewrites(self, cache: CacheManager) -> None:
        """Rows whose first slots the cache manager set (a matched prefix, or
        duplicates moved onto the cache's copies) go with this step."""
        synced = [r for r in self.reqs if r.table_sync_len]
        self.table_rows = [r.req_pool_idx for r in synced]
        self.table_lens = [r.table_sync_len for r in synced]
        self.table_slots = [s for r in synced for s in cache.table[r.req_pool_idx, :r.table_sync_len].tolist()]
        for r in synced:
            r.table_sync_len = 0

    def penalty_rows(self, seq_lens: list[int]) -> list[int]:
        """Rows whose next token is penalized and kept: not a mid-prompt chunk,
        nor a finished row computed as padding (static batching)."""
        if not self.has_penalties:
            return []
        return [i for i, r in enumerate(self.reqs)
                if r.penalized and not r.finished and self.keeps_token(i, seq_lens[i])
                and r.penalizes_next_token()]

    def grammar_rows(self, seq_lens: list[int]) -> list[int]:
        """Rows whose next token a grammar constrains: not a mid-prompt chunk,
        nor a finished row computed as padding. Their matchers have seen every
        token (the scheduler reads a step in flight before building one)."""
        if not self.has_grammar and not any(r.thinking is not None for r in self.reqs):
            return []
        rows = [i for i, r in enumerate(self.reqs)
                if (r.grammar is not None or (r.thinking is not None and r.thinking.forced_next is not None))
                and not r.finished and self.keeps_token(i, seq_lens[i])]
        assert all(not self.reqs[i].pending_tokens for i in rows), "a grammar row with a token in flight"
        return rows

    def constraint_bitmask(self, rows: list[int]) -> bytes:
        """The allowed tokens of each constrained row: its grammar's, or the one
        token a spent thinking budget forces."""
        if not rows:
            return b""
        reqs = [self.reqs[i] for i in rows]
        if all(r.grammar is not None for r in reqs):
            return fill_bitmask([r.grammar for r in reqs])
        vocab = next(r.thinking.vocab_size for r in reqs if r.thinking is not None)
        bitmask = new_bitmask(len(reqs), vocab, for_grammar=any(r.grammar is not None for r in reqs))
        for i, r in enumerate(reqs):
            forced = r.thinking.forced_next if r.thinking is not None else None
            if forced is None:
                r.grammar.matcher.fill_next_token_bitmask(bitmask, i)
            else:
                allow_only(bitmask, i, forced)
        return np.asarray(bitmask).tobytes()

    def draft_bitmask(self, rows: list[int], drafts: list[list[int]]) -> bytes:
        """A verify step's masks for its constrained rows, 1 + len(drafts[i])
        rows each in token order: a grammar row's before and after each of its
        drafts, a forced thinking tag's row its one token."""
        if not rows:
            return b""
        reqs = [self.reqs[i] for i in rows]
        # the model's logits width (a grammar's is the same: ReqGrammar's tokenizer info is built with it)
        vocab = next((r.thinking.vocab_size for r in reqs if r.thinking is not None), None) \
            or reqs[0].grammar.vocab_size
        bitmask = new_bitmask(sum(1 + len(drafts[i]) for i in rows), vocab,
                              for_grammar=any(r.grammar is not None for r in reqs))
        at = 0
        for i, r in zip(rows, reqs):
            if r.grammar is not None:
                fill_draft_bitmask(bitmask, at, r.grammar, drafts[i])
            else:
                assert not drafts[i], "a forced thinking tag's row drafts nothing (ThinkingBudget.draft_room)"
                allow_only(bitmask, at, r.thinking.forced_next)
            at += 1 + len(drafts[i])
        return np.asarray(bitmask).tobytes()

    def to_forward_batch(self) -> ForwardBatch:
        seq_lens = self.seq_lens
        if self.forward_mode is ForwardMode.VERIFY:
            grammar_rows, grammar_bitmask = self.draft_grammar
        else:
            grammar_rows = self.grammar_rows(seq_lens)
            grammar_bitmask = self.constraint_bitmask(grammar_rows)
        decode_rows = len(self.reqs) - self.decode_from
        mixed = self.forward_mode is ForwardMode.EXTEND and decode_rows > 0
        return ForwardBatch(
            forward_mode=ForwardMode.MIXED if mixed else self.forward_mode,
            decode_rows=decode_rows if mixed else 0,
            req_pool_indices=self.req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=self.prefix_lens,
            input_ids=self.input_ids,
            out_cache_loc=self.out_cache_loc.tolist(),
            temperatures=self.temperatures,
            top_ps=self.top_ps,
            top_ks=self.top_ks,
            min_ps=self.min_ps,
            seeds=self.seeds,
            sample_steps=[len(r.output_ids) + r.pending_tokens for r in self.reqs],
            return_logprob=self.return_logprob,
            top_logprobs_nums=self.top_logprobs_nums if self.return_logprob else [],
            table_rows=self.table_rows, table_lens=self.table_lens, table_slots=self.table_slots,
            kv_copy_src=self.kv_copy_src, kv_copy_dst=self.kv_copy_dst, window_pages=self.window_pages,
            penalty_rows=self.penalty_rows(seq_lens), penalty_inits=self.penalty_inits,
            input_logprob_rows=self.input_logprob_rows, input_logprob_starts=self.input_logprob_starts,
            input_logprob_targets=self.input_logprob_targets,
            token_ids_logprobs=[r.token_ids_logprob for r in self.reqs]
            if any(r.token_ids_logprob for r in self.reqs) else [],
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
        )


class NeedsResults(Enum):
    """What a batch chooser returns when it cannot choose before the step in
    flight is processed (its finished rows free KV, its tokens are needed)."""

    NEEDS_RESULTS = "needs results"


NEEDS_RESULTS = NeedsResults.NEEDS_RESULTS
