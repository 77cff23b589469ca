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
a batch without any costs nothing. The state is kept in the form the logits
need, as SGLang's penalizers do: per row and token an additive term
(frequency * count + presence * (count > 0) - bias) and a repetition scale
(the penalty where the token was seen, else 1), updated in place for the one
token each row samples. A step reads and writes only the entries whose
terms are not neutral (each row's `touched` tokens: seen in the prompt or
output, or biased), since a neutral term (scale 1, additive 0) leaves a logit
bit-identical: its cost follows the tokens the rows have seen, not the
vocabulary (bench/RESULTS.md, "What penalties cost per decode step"). The
repetition pass is skipped when no penalized row needs it; min_new_tokens
sets the row's stop ids to -inf. The dense tensors ([rows, vocab]) are
allocated the first time a request uses penalties.

Formulas (`penalty_terms` and `apply_penalties`, in this order):
- repetition (HF/CTRL): a token seen in the prompt or the output has its
  logit divided by the penalty if positive, multiplied by it if not;
- frequency and presence (OpenAI): logit -= count * frequency
  + (count > 0) * presence, count over the output tokens so far;
- logit_bias: logit += bias;
- min_new_tokens: the row's stop tokens (EOS unless ignore_eos, and its
  stop_token_ids) get -inf while fewer than min_new_tokens were generated.
A parameter at its neutral value leaves the logits bit-identical.
"""

from __future__ import annotations

import torch

from common.messages import ForwardBatch, PenaltyInit


def penalty_terms(counts: torch.Tensor, seen: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                  repetition: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and token, from their definitions: (repetition scale, additive
    term). counts [P, V] (output token counts), seen [P, V] bool (in prompt or
    output), per-row parameters [P], bias [P, V]."""
    scale = torch.where(seen, repetition[:, None], torch.ones((), dtype=torch.float32, device=seen.device))
    c = counts.to(torch.float32)
    return scale, frequency[:, None] * c + presence[:, None] * (c > 0).to(torch.float32) - bias


def apply_penalties(logits: torch.Tensor, scale: torch.Tensor | None, additive: torch.Tensor,
                    stop_masked: torch.Tensor | None = None) -> torch.Tensor:
    """logits [P, V] float32 (a copy: it may be written in place) -> penalized
    logits. scale None: no row uses a repetition penalty; stop_masked [P, V]
    bool: the tokens to forbid, None: none."""
    x = logits if scale is None else torch.where(logits > 0, logits / scale, logits * scale)
    x.sub_(additive)
    return x if stop_masked is None else x.masked_fill_(stop_masked, float("-inf"))


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.allocated = False
        # host copies, so a step knows without a device sync which passes it needs
        self.uses_repetition = [False] * num_rows
        self.min_new_host = [0] * num_rows
        # per row, every token whose scale or additive term may differ from
        # neutral (seen in the prompt or output, or biased): a step touches
        # only these, since a neutral term leaves a logit bit-identical
        self.touched: dict[int, torch.Tensor] = {}
        self.touched_set: dict[int, set[int]] = {}
        self.stop_ids: dict[int, torch.Tensor] = {}  # masked while min_new_tokens is not reached

    def _allocate(self) -> None:
        r, v, dev = self.num_rows, self.vocab_size, self.device
        self.counts = torch.zeros(r, v, dtype=torch.int32, device=dev)  # output tokens
        self.bias = torch.zeros(r, v, dtype=torch.float32, device=dev)
        self.scale = torch.ones(r, v, dtype=torch.float32, device=dev)  # repetition where seen, else 1
        self.additive = torch.zeros(r, v, dtype=torch.float32, device=dev)  # subtracted from the logits
        self.frequency = torch.zeros(r, dtype=torch.float32, device=dev)
        self.presence = torch.zeros(r, dtype=torch.float32, device=dev)
        self.repetition = torch.ones(r, dtype=torch.float32, device=dev)
        self.allocated = True

    @property
    def nbytes(self) -> int:
        if not self.allocated:
            return 0
        return sum(t.numel() * t.element_size() for t in (
            self.counts, self.bias, self.scale, self.additive, self.frequency,
            self.presence, self.repetition))

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
        seen = self.counts[row] > 0
        if init.prompt_ids:
            seen[torch.tensor(init.prompt_ids, dtype=torch.int64, device=dev)] = True
        self.bias[row] = 0.0
        if init.logit_bias:
            ids = torch.tensor(list(init.logit_bias), dtype=torch.int64, device=dev)
            self.bias[row, ids] = torch.tensor(list(init.logit_bias.values()), dtype=torch.float32,
                                               device=dev)
        stops = [t for t in init.stop_ids if 0 <= t < self.vocab_size]  # larger ids are never sampled
        self.frequency[row] = init.frequency_penalty
        self.presence[row] = init.presence_penalty
        self.repetition[row] = init.repetition_penalty
        scale, additive = penalty_terms(self.counts[row:row + 1], seen[None], self.frequency[row:row + 1],
                                        self.presence[row:row + 1], self.repetition[row:row + 1],
                                        self.bias[row:row + 1])
        self.scale[row], self.additive[row] = scale[0], additive[0]
        touched = torch.nonzero((self.scale[row] != 1.0) | (self.additive[row] != 0.0))[:, 0]
        self.touched[row] = touched
        self.touched_set[row] = set(touched.tolist())
        self.stop_ids[row] = torch.tensor(stops, dtype=torch.int64, device=dev)
        self.uses_repetition[row] = init.repetition_penalty != 1.0
        self.min_new_host[row] = init.min_new_tokens if stops else 0

    def _positions_and_rows(self, batch: ForwardBatch, positions: torch.Tensor | None,
                            pool_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """batch.penalty_rows and their req_to_token rows, as tensors: from the
        step's inputs (positions: StepInputs.penalty_rows, pool_rows: its
        req_pool_indices), or built here from the batch's lists."""
        if positions is None:
            positions = torch.tensor(batch.penalty_rows, dtype=torch.int64, device=self.device)
        if pool_rows is None:
            pool_rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64, device=self.device)
        return positions, pool_rows[positions]

    def apply(self, logits: torch.Tensor, batch: ForwardBatch, positions: torch.Tensor | None = None,
              pool_rows: torch.Tensor | None = None) -> None:
        """Penalize, in place, the logits [B, V] of the rows in batch.penalty_rows:
        only the entries whose terms are not neutral (`touched`), so a step
        costs in proportion to the tokens the rows have seen, not to the
        vocabulary."""
        dev = self.device
        rows_host = [batch.req_pool_indices[i] for i in batch.penalty_rows]
        lengths = torch.tensor([len(self.touched[r]) for r in rows_host], dtype=torch.int64, device=dev)
        positions, pen_rows = self._positions_and_rows(batch, positions, pool_rows)
        pos = torch.repeat_interleave(positions, lengths)
        rows = torch.repeat_interleave(pen_rows, lengths)
        toks = torch.cat([self.touched[r] for r in rows_host])
        scale = self.scale[rows, toks] if any(self.uses_repetition[r] for r in rows_host) else None
        logits[pos, toks] = apply_penalties(logits[pos, toks], scale, self.additive[rows, toks])
        # the token being sampled is number sample_steps + 1
        for i, r in zip(batch.penalty_rows, rows_host):
            if batch.sample_steps[i] < self.min_new_host[r]:
                logits[i, self.stop_ids[r]] = float("-inf")

    def update(self, batch: ForwardBatch, next_ids: torch.Tensor, positions: torch.Tensor | None = None,
               pool_rows: torch.Tensor | None = None) -> None:
        """Count the tokens just sampled for the rows in batch.penalty_rows, and
        bring their terms up to date (a row appears once in a batch, so the
        scatters have no duplicates). positions, pool_rows: as apply's."""
        pos, rows = self._positions_and_rows(batch, positions, pool_rows)
        ids = next_ids[pos]
        c = self.counts[rows, ids] + 1
        self.counts[rows, ids] = c
        # the same expression as penalty_terms for a count c > 0, so the result is bit-identical
        self.additive[rows, ids] = self.frequency[rows] * c.to(torch.float32) \
            + self.presence[rows] * torch.ones((), dtype=torch.float32, device=self.device) \
            - self.bias[rows, ids]
        self.scale[rows, ids] = self.repetition[rows]
        for r, t in zip(rows.tolist(), ids.tolist()):
            if t not in self.touched_set[r]:
                self.touched_set[r].add(t)
                self.touched[r] = torch.cat([self.touched[r], torch.tensor([t], dtype=torch.int64,
                                                                           device=self.device)])
