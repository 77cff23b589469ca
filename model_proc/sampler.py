"""One token per row from last-position logits.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a
draw from p. It needs no cumulative sums, and a seeded row only has to
generate its own noise vector from a generator seeded by (seed, step), so its
draw never depends on which other rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_proc.layers import native_layers_op

GREEDY_EPS = 1e-6
_MASK64 = (1 << 64) - 1


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
    """Structured output: in place, -inf for every token of logits row
    `rows[j]` whose bit is clear in row j of `bitmask` (int32 words, bit t % 32
    of word t // 32 for token t; ForwardBatch.grammar_bitmask). xgrammar's
    CPU kernel does it (faster here than unpacking the bits with torch ops)."""
    import xgrammar as xgr

    compact = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(rows), -1)
    full = torch.full((logits.shape[0], compact.shape[1]), -1, dtype=torch.int32)  # -1: every token allowed
    full[torch.tensor(rows, dtype=torch.int64)] = compact
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=logits.shape[1], indices=rows)


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors on the device, built once per step."""

    temperatures: torch.Tensor  # [B] float32
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, <= 0 means off
    min_ps: torch.Tensor  # [B] float32
    seeds: list[int]  # -1: unseeded
    steps: list[int]  # tokens generated so far, per row
    all_greedy: bool
    need_sort: bool  # some sampled row uses top-k or top-p
    need_min_p: bool

    @classmethod
    def from_lists(cls, temperatures: list[float], top_ps: list[float], top_ks: list[int],
                   min_ps: list[float], seeds: list[int], steps: list[int],
                   device: str | torch.device = "cpu",
                   tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   ) -> "SamplingBatch":
        """tensors: the four lists already on the device (temperatures, top_ps,
        top_ks, min_ps: the step's StepInputs has them); else built here."""
        sampled = [i for i, t in enumerate(temperatures) if t >= GREEDY_EPS]
        if tensors is None:
            tensors = (torch.tensor(temperatures, dtype=torch.float32, device=device),
                       torch.tensor(top_ps, dtype=torch.float32, device=device),
                       torch.tensor(top_ks, dtype=torch.int64, device=device),
                       torch.tensor(min_ps, dtype=torch.float32, device=device))
        return cls(
            temperatures=tensors[0], top_ps=tensors[1], top_ks=tensors[2], min_ps=tensors[3],
            seeds=list(seeds), steps=list(steps),
            all_greedy=not sampled,
            need_sort=any(top_ks[i] > 0 or top_ps[i] < 1.0 for i in sampled),
            need_min_p=any(min_ps[i] > 0.0 for i in sampled),
        )


def per_token(values: list, lens: list[int]) -> list:
    """A per-row list repeated for each of the row's lens[i] tokens."""
    return [v for v, n in zip(values, lens) for _ in range(n)]


def accept_drafts(input_ids: list[int], lens: list[int], sampled: list[int]) -> list[int]:
    """A verify step's rule (ForwardMode.VERIFY): row i's lens[i] inputs are
    its last token and its drafts, and sampled[j] the token sampled after
    input j. The row keeps its samples up to and including the first that
    differs from the draft it follows: a draft is kept exactly when the
    target, sampled at that position, would have produced it. With a draft
    that is one fixed token this is rejection sampling itself: P(kept) =
    p(draft), and a differing sample is a draw from p with the draft
    excluded, renormalised (the residual distribution). Returns each row's
    count of kept samples (1 + its accepted drafts)."""
    kept, start = [], 0
    for n in lens:
        a = 1
        while a < n and sampled[start + a - 1] == input_ids[start + a]:
            a += 1
        kept.append(a)
        start += n
    return kept


def logprobs_of_ids(logprobs: torch.Tensor, ids: list[int]) -> list[list[float]]:
    """logprobs [N, V] -> per row, the logprob of each of `ids` (SGLang's
    token_ids_logprob), in their order: one gather for all the rows."""
    index = torch.tensor(ids, dtype=torch.int64, device=logprobs.device)
    return logprobs.index_select(1, index).tolist()


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [B, V], the first of equal maxima, NaN the
    largest (as argmax). On a CPU the native op where it runs (one
    vectorized pass for the max, one for its first index); else torch's
    max(dim), which finds the same index faster than argmax (ties and NaN
    checked equal)."""
    op = native_layers_op(x.device, None) if x.dtype == torch.float32 and x.dim() == 2 else None
    if op is not None and x.stride(-1) == 1:
        return op.argmax_rows(x)
    return x.max(dim=-1).indices


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step) (splitmix64 finaliser), so that
    nearby seeds and steps give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, random_seed: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        # unseeded rows share this stream: reproducible per server run only
        self.generator = torch.Generator(self.device).manual_seed(random_seed)

    def __call__(self, logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64."""
        greedy_ids = first_argmax(logits)
        if params.all_greedy:
            return greedy_ids
        greedy = params.temperatures < GREEDY_EPS
        temps = torch.where(greedy, 1.0, params.temperatures)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if params.need_sort:
            probs = self._top_k_top_p(probs, params.top_ks, params.top_ps)
        if params.need_min_p:
            floor = params.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = self._exponential_noise(probs.shape, params)
        sampled_ids = first_argmax(probs / noise)
        return torch.where(greedy, greedy_ids, sampled_ids)

    @staticmethod
    def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_ks > 0, top_ks, probs.shape[-1])
        # a token is cut when the mass strictly before it already reaches top_p;
        # the most likely token therefore always survives
        before = sorted_p.cumsum(dim=-1) - sorted_p
        # (top_p == 1 is off: rounding in the cumsum must not cut the tail)
        cut = (rank >= k[:, None]) | ((before >= top_ps[:, None]) & (top_ps[:, None] < 1.0))
        cut &= rank > 0  # a top_p that rounds to 0 in float32 must not cut every token
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p)

    def _exponential_noise(self, shape: torch.Size, params: SamplingBatch) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        for row, seed in enumerate(params.seeds):
            if seed >= 0:
                g = torch.Generator(self.device).manual_seed(mix_seed(seed, params.steps[row]))
                noise[row].exponential_(generator=g)
        # E == 0 would turn a zero-probability token into 0/0
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
