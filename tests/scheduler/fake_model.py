"""A fake model process for scheduler unit tests: it isolates the scheduler from
the real model, and checks the KV the scheduler hands it.

Like the model process, it keeps its own `req_to_token` table, written only
from what the batches carry (new tokens' slots, rows the scheduler rewrote),
and each row's last sampled token for decode inputs sent as FUTURE_TOKEN (the
overlap schedule; also the running rows of a mixed step, --enable-mixed-chunk).

Its "KV" is a fingerprint per slot: the position it was written at, and a
hash chained over every token of the sequence up to it. Before a row computes,
every slot of its prefix must hold position i and chain onto the slot before
it, so a slot that another request overwrote, a prefix taken from the wrong
cached sequence, or a table row the model was not told about all fail here.
By default the next token is a pure function of the row's last input token
(tests compute expected outputs from it); `content_dependent=True` makes it a
function of the whole chain instead, so a run that reused a wrong prefix
produces different tokens from a run without any cache.

KV copies (`kv_copy_src`/`kv_copy_dst`, a prefix match that ends inside a
page) copy the fingerprints, before the step writes anything: a copy from
the wrong slot, or from one overwritten since, fails the prefix check of the
request that reads it.

Penalties: it keeps each row's penalty history as the model process does
(the output ids of the row's `PenaltyInit`, plus every token it samples for
the row while the row is in `penalty_rows`), and a penalized row's next token
depends on that history (`penalized_next_token`): a history that misses a
token (after a retraction, under the overlap schedule) or counts one the
request never got (a mid-prompt chunk) changes the output.

Speculative verify steps (ForwardMode.VERIFY) sample after every token of a
row and keep the agreeing drafts by the model process's own rule
(`accept_drafts`); the slots of rejected drafts hold their fingerprints until
reused, so a row whose length was not trimmed back reads a wrong prefix.
"""

from __future__ import annotations

import itertools

import torch

from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode, ForwardResult, ModelInfo
from model_proc.sampler import accept_drafts

VOCAB = 1000
EOS = 2
_MOD = (1 << 61) - 1


def fake_model_info(max_total_tokens: int = 4096, context_len: int = 512) -> ModelInfo:
    return ModelInfo(model_path="fake", tokenizer_path="fake", served_model_name="fake",
                     context_len=context_len, max_total_tokens=max_total_tokens,
                     vocab_size=VOCAB, eos_token_ids=[EOS], dtype="float32", device="cpu",
                     kv_cache_bytes=0)


def next_token(last: int, eos_one_in: int = 0) -> int:
    """Never EOS by itself unless eos_one_in > 0: then EOS after about one token in that many."""
    nxt = (last * 7 + 3) % VOCAB
    if eos_one_in and (last * 2654435761) % 1009 % eos_one_in == 0:
        return EOS
    return nxt if nxt != EOS else 5


def penalized_next_token(last: int, history: list[int]) -> int:
    """A penalized row's next token: a function of its last token and of the
    output ids the model holds for it."""
    nxt = (last * 7 + 3 + 11 * len(history) + 5 * sum(history)) % VOCAB
    return nxt if nxt != EOS else 5


def penalized_expected(prompt_last: int, n: int) -> list[int]:
    out: list[int] = []
    last = prompt_last
    for _ in range(n):
        last = penalized_next_token(last, out)
        out.append(last)
    return out


def chain(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % _MOD


class FakeModel:
    def __init__(self, eos_one_in: int = 0, content_dependent: bool = False,
                 max_total_tokens: int = 1 << 14, max_rows: int = 1024, context_len: int = 4096,
                 jitter_one_in: int = 0) -> None:
        """jitter_one_in > 0: at about one position in that many, the next token
        also depends on the position (an output that loops, but not exactly:
        drafts looked up in it are sometimes wrong)."""
        self.eos_one_in = eos_one_in
        self.content_dependent = content_dependent
        self.jitter_one_in = jitter_one_in
        self.batches: list[ForwardBatch] = []
        self.last_sampled: dict[int, int] = {}  # req_pool_idx -> token sampled last
        self.penalty_history: dict[int, list[int]] = {}  # req_pool_idx -> output ids held for it
        self.copied_rows = 0  # KV rows copied (ForwardBatch.kv_copy_src/dst)
        self.verify_steps = 0  # ForwardMode.VERIFY steps run
        # grown by rows as they are used: a whole table (1025 x 4096 x 8 bytes) zeroed for
        # each of the suite's thousands of fake models cost seconds
        self.max_rows, self.context_len = max_rows, context_len
        self.table = torch.zeros(0, context_len, dtype=torch.int64)
        self.slot_pos = torch.full((max_total_tokens + 1,), -1, dtype=torch.int64)
        self.slot_prev = torch.zeros(max_total_tokens + 1, dtype=torch.int64)
        self.slot_hash = torch.zeros(max_total_tokens + 1, dtype=torch.int64)

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        self.batches.append(batch)
        rows = batch.req_pool_indices
        start = 0
        self._grow_table(max(itertools.chain(rows, batch.table_rows), default=0))
        for row, n in zip(batch.table_rows, batch.table_lens):
            self.table[row, :n] = torch.tensor(batch.table_slots[start:start + n])
            start += n
        if batch.kv_copy_src:  # before anything the step writes, as the model process does
            src, dst = torch.tensor(batch.kv_copy_src), torch.tensor(batch.kv_copy_dst)
            assert not set(batch.kv_copy_dst) & set(batch.out_cache_loc), "a copy into a slot the step writes"
            assert bool((self.slot_pos[src] >= 0).all()), "a copy from a slot never written"
            for fp in (self.slot_pos, self.slot_prev, self.slot_hash):
                fp[dst] = fp[src]
            self.copied_rows += len(batch.kv_copy_src)
        if batch.forward_mode.is_extend():  # EXTEND or MIXED
            counts = [s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)]
            prefixes = batch.prefix_lens
        else:
            counts = [1] * len(rows)
            prefixes = [s - 1 for s in batch.seq_lens]
        assert sum(counts) == len(batch.out_cache_loc) == len(batch.input_ids)
        assert 0 not in batch.out_cache_loc, "slot 0 is the padding dummy"
        # each token of a step its own slot: two in one slot and one token's KV is lost
        assert len(set(batch.out_cache_loc)) == len(batch.out_cache_loc), "two tokens of a step share a slot"
        # FUTURE_TOKEN: the row's token sampled last, only where a row decodes
        # one token (a decode step, or a running row inside a mixed extend)
        token_rows = [(row, n) for row, n in zip(rows, counts) for _ in range(n)]
        input_ids = [self.last_sampled[row] if t == FUTURE_TOKEN and n == 1 else t
                     for (row, n), t in zip(token_rows, batch.input_ids)]
        assert min(input_ids) >= 0, "FUTURE_TOKEN outside a one-token row"
        for row, p in zip(rows, prefixes):
            self._check_prefix(row, p)
        for init in batch.penalty_inits:
            self.penalty_history[rows[init.row]] = list(init.output_ids)
        penalized = set(batch.penalty_rows)
        verify = batch.forward_mode is ForwardMode.VERIFY
        out, start = [], 0
        for pos, (row, p, n) in enumerate(zip(rows, prefixes, counts)):
            h = int(self.slot_hash[self.table[row, p - 1]]) if p else 0
            for i in range(n):
                slot, token = batch.out_cache_loc[start + i], input_ids[start + i]
                self.table[row, p + i] = slot
                self.slot_pos[slot], self.slot_prev[slot] = p + i, h
                h = chain(h, token)
                self.slot_hash[slot] = h
                if verify and pos not in penalized:  # every token is sampled
                    out.append(self.sample(h, token, p + i))
            start += n
            if verify and pos not in penalized:
                continue
            last = input_ids[start - 1]
            if pos in penalized:
                assert not verify or n == 1, "a penalized row with drafts"
                history = self.penalty_history[row]
                out.append(penalized_next_token(last, history))
                history.append(out[-1])
            else:
                out.append(self.sample(h, last, p + n - 1))
        if verify:
            kept = accept_drafts(input_ids, counts, out)
            ends = itertools.accumulate(counts)
            self.last_sampled.update((row, out[end - n + a - 1]) for row, end, n, a in zip(rows, ends, counts, kept))
            self.verify_steps += 1
            return ForwardResult(next_token_ids=out, accept_lens=kept)
        self.last_sampled.update(zip(rows, out))
        return ForwardResult(next_token_ids=out)

    def _grow_table(self, row: int) -> None:
        """Rows 0..row (and then some) exist, zeros where never written."""
        assert row <= self.max_rows, f"table row {row} past the model's {self.max_rows} rows"
        if row >= self.table.shape[0]:
            rows = min(self.max_rows + 1, max(row + 1, 2 * self.table.shape[0], 64))
            grown = torch.zeros(rows, self.context_len, dtype=torch.int64)
            grown[:self.table.shape[0]] = self.table
            self.table = grown

    def sample(self, chained: int, last: int, position: int) -> int:
        """The token after `last` at `position` (chained: the hash up to it)."""
        token = next_token(chained % VOCAB if self.content_dependent else last, self.eos_one_in)
        if self.jitter_one_in and (position * 2654435761) % 1013 % self.jitter_one_in == 0:
            token = (token + position) % (VOCAB - 10) + 10
        return token

    def _check_prefix(self, row: int, n: int) -> None:
        """The row's first n positions hold one consistent sequence."""
        if n == 0:
            return
        slots = self.table[row, :n]
        assert bool((slots > 0).all()), f"row {row}: a prefix position has no slot"
        assert torch.equal(self.slot_pos[slots], torch.arange(n)), \
            f"row {row}: a prefix slot holds another position's KV"
        assert int(self.slot_prev[slots[0]]) == 0 and \
            torch.equal(self.slot_prev[slots[1:]], self.slot_hash[slots[:-1]]), \
            f"row {row}: its prefix slots do not chain into one sequence (overwritten or mismatched)"
