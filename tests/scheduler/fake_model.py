"""A fake model process for scheduler unit tests: it isolates the scheduler from
the real model. Its next token is a pure function of the row's last input token,
and it checks that no slot it is asked to write is held by another live row.
Like the model process, it keeps each row's last sampled token for decode
inputs sent as FUTURE_TOKEN (the overlap schedule)."""

from __future__ import annotations

from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardResult, ModelInfo

VOCAB = 1000
EOS = 2


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


class FakeModel:
    def __init__(self, eos_one_in: int = 0) -> None:
        self.eos_one_in = eos_one_in
        self.slot_owner: dict[int, int] = {}  # slot -> req_pool_idx
        self.batches: list[ForwardBatch] = []
        self.last_sampled: dict[int, int] = {}  # req_pool_idx -> token sampled last

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        self.batches.append(batch)
        rows = batch.req_pool_indices
        if batch.forward_mode == "extend":
            counts = [s - p for s, p in zip(batch.seq_lens, batch.prefix_lens)]
            fresh = {row for row, p in zip(rows, batch.prefix_lens) if p == 0}
            # a row starting from an empty prefix belongs to a new request now
            self.slot_owner = {s: r for s, r in self.slot_owner.items() if r not in fresh}
        else:
            counts = [1] * len(rows)
        owners = [row for row, n in zip(rows, counts) for _ in range(n)]
        assert len(owners) == len(batch.out_cache_loc) == len(batch.input_ids)
        live_rows = set(rows)
        for slot, row in zip(batch.out_cache_loc, owners):
            assert slot != 0, "slot 0 is the padding dummy"
            prev = self.slot_owner.get(slot)
            # a slot may be reused only once its previous owner is gone
            assert prev is None or prev == row or prev not in live_rows, \
                f"slot {slot} of live row {prev} handed to row {row}"
            self.slot_owner[slot] = row
        input_ids = list(batch.input_ids)
        if batch.forward_mode == "decode":
            input_ids = [self.last_sampled[row] if t == FUTURE_TOKEN else t
                         for row, t in zip(rows, input_ids)]
        assert min(input_ids) >= 0, "FUTURE_TOKEN outside a decode batch"
        last_positions, start = [], 0
        for n in counts:
            start += n
            last_positions.append(start - 1)
        out = [next_token(input_ids[i], self.eos_one_in) for i in last_positions]
        self.last_sampled.update(zip(rows, out))
        return ForwardResult(next_token_ids=out)
