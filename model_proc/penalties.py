"""Penalties on the logits, batched, with their per-row state.

The state is kept per `req_to_token` row, in the model process, because only
the model knows every sampled token when it needs it: with the overlap
schedule the scheduler sends step t+1 before it has read step t's token.
A row's state is (re)built from what the scheduler sends at the row's first
extend after admission (`PenaltyInit`: the output so far and, for the
repetition penalty, the prompt), never from the forward, since a prefix served
by the prefix cache is not recomputed; after that the model adds each token
it samples for the row. A retracted request is re-extended, so its state is
rebuilt the same way, in whatever row it gets.

Per step only the rows listed in `ForwardBatch.penalty_rows` are touched, and
a batch without any costs nothing. The dense tensors ([rows, vocab]) are
allocated the first time a request uses penalties.

Formulas (`apply_penalties`, in this order):
- repetition (HF/CTRL): a token seen in the prompt or the output has its
  logit divided by the penalty if positive, multiplied by it if not;
- frequency and presence (OpenAI): logit -= count * frequency
  + (count > 0) * presence, count over the output tokens so far;
- logit_bias: logit += bias;
- min_new_tokens: the row's stop tokens (EOS unless ignore_eos, and its
  stop_token_ids) get -inf while fewer than min_new_tokens were generated.
"""

from __future__ import annotations

import torch

from common.messages import ForwardBatch, PenaltyInit


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor, repetition: torch.Tensor,
                    bias: torch.Tensor, stop_masked: torch.Tensor) -> torch.Tensor:
    """logits [P, V] float32 -> penalized logits. counts [P, V] (output token
    counts), seen [P, V] bool (in prompt or output), per-row parameters [P],
    bias [P, V], stop_masked [P, V] bool (tokens to forbid). A parameter at its
    neutral value leaves the logits bit-identical."""
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.to(x.dtype)
    x = x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(x.dtype)
    x = x + bias
    return x.masked_fill(stop_masked, float("-inf"))


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.allocated = False

    def _allocate(self) -> None:
        r, v, dev = self.num_rows, self.vocab_size, self.device
        self.counts = torch.zeros(r, v, dtype=torch.int32, device=dev)  # output tokens
        self.seen = torch.zeros(r, v, dtype=torch.bool, device=dev)  # prompt or output tokens
        self.bias = torch.zeros(r, v, dtype=torch.float32, device=dev)
        self.stop_mask = torch.zeros(r, v, dtype=torch.bool, device=dev)
        self.frequency = torch.zeros(r, dtype=torch.float32, device=dev)
        self.presence = torch.zeros(r, dtype=torch.float32, device=dev)
        self.repetition = torch.ones(r, dtype=torch.float32, device=dev)
        self.min_new_tokens = torch.zeros(r, dtype=torch.int64, device=dev)
        self.allocated = True

    @property
    def nbytes(self) -> int:
        if not self.allocated:
            return 0
        return sum(t.numel() * t.element_size() for t in (
            self.counts, self.seen, self.bias, self.stop_mask, self.frequency, self.presence,
            self.repetition, self.min_new_tokens))

    def init_rows(self, batch: ForwardBatch) -> None:
        """Rebuild the state of the rows in batch.penalty_inits (before the step samples)."""
        if not self.allocated:
            self._allocate()
        for init in batch.penalty_inits:
            self._init_row(batch.req_pool_indices[init.row], init)

    def _init_row(self, row: int, init: PenaltyInit) -> None:
        dev = self.device
        out = torch.tensor(init.output_ids, dtype=torch.int64, device=dev)
        self.counts[row] = torch.bincount(out, minlength=self.vocab_size).to(torch.int32)
        self.seen[row] = self.counts[row] > 0
        if init.prompt_ids:
            self.seen[row, torch.tensor(init.prompt_ids, dtype=torch.int64, device=dev)] = True
        self.bias[row] = 0.0
        if init.logit_bias:
            ids = torch.tensor(list(init.logit_bias), dtype=torch.int64, device=dev)
            self.bias[row, ids] = torch.tensor(list(init.logit_bias.values()), dtype=torch.float32,
                                               device=dev)
        self.stop_mask[row] = False
        stops = [t for t in init.stop_ids if 0 <= t < self.vocab_size]  # larger ids are never sampled
        if init.min_new_tokens > 0 and stops:
            self.stop_mask[row, torch.tensor(stops, dtype=torch.int64, device=dev)] = True
        self.frequency[row] = init.frequency_penalty
        self.presence[row] = init.presence_penalty
        self.repetition[row] = init.repetition_penalty
        self.min_new_tokens[row] = init.min_new_tokens

    def _rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.tensor(batch.penalty_rows, dtype=torch.int64, device=self.device)
        rows = torch.tensor([batch.req_pool_indices[i] for i in batch.penalty_rows], dtype=torch.int64,
                            device=self.device)
        return pos, rows

    def apply(self, logits: torch.Tensor, batch: ForwardBatch) -> None:
        """Penalize, in place, the logits [B, V] of the rows in batch.penalty_rows."""
        pos, rows = self._rows(batch)
        steps = torch.tensor([batch.sample_steps[i] for i in batch.penalty_rows], dtype=torch.int64,
                             device=self.device)
        early = steps < self.min_new_tokens[rows]  # the token being sampled is number steps + 1
        logits[pos] = apply_penalties(
            logits[pos], self.counts[rows], self.seen[rows], self.frequency[rows],
            self.presence[rows], self.repetition[rows], self.bias[rows],
            self.stop_mask[rows] & early[:, None])

    def update(self, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Count the tokens just sampled for the rows in batch.penalty_rows (a
        row appears once in a batch, so the scatter has no duplicates)."""
        pos, rows = self._rows(batch)
        ids = next_ids[pos]
        self.counts[rows, ids] += 1
        self.seen[rows, ids] = True
