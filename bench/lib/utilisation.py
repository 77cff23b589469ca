"""Batch utilisation of static batching: useful row-steps over computed row-steps.

A static batch of B rows with output lengths n_1..n_B runs max(n) steps over
all B rows, so its utilisation is sum(n) / (B * max(n)) = mean / max. For
i.i.d. exponential lengths the chapter approximates E[mean/max] by
E[mean]/E[max] = 1/H_B (H_B the B-th harmonic number); `expected_utilisation`
estimates E[mean/max] itself by sampling, to plot the two side by side.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def harmonic(b: int) -> float:
    return float(sum(1.0 / k for k in range(1, b + 1)))


def batch_utilisation(batches: Sequence[Sequence[int]]) -> float:
    """Over several static batches: total kept tokens over total row-steps."""
    useful = sum(sum(b) for b in batches if b)
    computed = sum(len(b) * max(b) for b in batches if b)
    return useful / computed if computed else 1.0


def expected_utilisation(b: int, mean: float, rng: np.random.Generator, samples: int = 20000,
                         rounded: bool = False) -> float:
    """Monte Carlo E[mean/max] of b exponential lengths (rounded to whole tokens,
    at least one, when `rounded`: what the traces actually draw)."""
    x = rng.exponential(mean, size=(samples, b))
    if rounded:
        x = np.maximum(1, np.rint(x))
    return float(np.mean(x.mean(axis=1) / x.max(axis=1)))


def groups_by_first_token(first_token_times: Sequence[float], max_batch: int, gap: float = 0.1) -> list[list[int]]:
    """Which requests shared a static batch, guessed from the client side: rows
    of one batch get their first token from the same prefill, so their first
    tokens arrive together; batches are at least a decode run apart. Returns
    request indices per batch (a cluster larger than max_batch is split)."""
    order = sorted(range(len(first_token_times)), key=lambda i: first_token_times[i])
    groups: list[list[int]] = []
    last = None
    for i in order:
        t = first_token_times[i]
        if last is None or t - last > gap or len(groups[-1]) == max_batch:
            groups.append([])
        groups[-1].append(i)
        last = t
    return groups
