"""Extend (prefill) attention over prefix-in-pool plus new tokens (Triton
interpreter) against its torch reference, and, with a sliding window or
soft-capping (Gemma 2/3), against a query-by-query oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.extend_attention import extend_attention_fwd, extend_attention_ref
from tests.kernels.kernel_inputs import (REL_TOL, extend_oracle, random_pool, ragged_pages, randn, rel_err,
                                         shuffled)

POOL = 1024
# (q_heads, kv_heads) per GQA ratio: small head counts keep the interpreter's grid small
HEADS = {1: (2, 2), 3: (6, 2), 4: (4, 1)}


@dataclass
class ExtendInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_extend_len: int
    scale: float

    def run(self, **options: float) -> torch.Tensor:
        o = torch.full_like(self.q, float("nan"))
        return extend_attention_fwd(self.q, self.k, self.v, o, self.k_buf, self.v_buf, self.qo_indptr,
                                    self.kv_indptr, self.kv_indices, self.max_extend_len, self.scale, **options)

    def ref(self, **options: float) -> torch.Tensor:
        return extend_attention_ref(self.q.float(), self.k.float(), self.v.float(), self.k_buf.float(),
                                    self.v_buf.float(), self.qo_indptr, self.kv_indptr, self.kv_indices,
                                    self.scale, **options)

    def oracle(self, sliding_window: int = 0, logit_cap: float = 0.0) -> torch.Tensor:
        return extend_oracle(self.q, self.k, self.v, self.k_buf, self.v_buf, self.qo_indptr, self.kv_indptr,
                             self.kv_indices, self.scale, sliding_window, logit_cap)


def extend_inputs(gen: torch.Generator, rows: list[tuple[int, int]], group: int, head_dim: int,
                  dtype: torch.dtype, q_scale: float = 1.0) -> ExtendInputs:
    """rows: (new tokens, prefix tokens) per request. q_scale > 1 spreads the
    scores, so that a logit cap has something to cap."""
    q_heads, kv_heads = HEADS[group]
    ext_lens, pre_lens = [n for n, _ in rows], [p for _, p in rows]
    k_buf, v_buf = random_pool(gen, POOL, kv_heads, head_dim, dtype)
    kv_indptr, kv_indices = ragged_pages(gen, pre_lens, POOL)
    qo_indptr, _ = ragged_pages(gen, ext_lens, POOL)
    total = sum(ext_lens)
    q = (randn(gen, total, q_heads, head_dim) * q_scale).to(dtype)
    # k/v as strided views of one fused tensor, like the model's qkv split
    kv = randn(gen, total, 2 * kv_heads, head_dim, dtype=dtype)
    return ExtendInputs(q, kv[:, :kv_heads], kv[:, kv_heads:], k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                        max(ext_lens), head_dim ** -0.5)


def run_extend(gen: torch.Generator, rows: list[tuple[int, int]], group: int, head_dim: int,
               dtype: torch.dtype) -> None:
    inputs = extend_inputs(gen, rows, group, head_dim, dtype)
    err = rel_err(inputs.run(), inputs.ref())
    assert err < REL_TOL[dtype], f"rows {rows}: relative error {err:.2e}"


def check_gemma(inputs: ExtendInputs, rows: list[tuple[int, int]], sliding_window: int = 0,
                logit_cap: float = 0.0) -> torch.Tensor:
    """Kernel and reference both equal the query-by-query oracle; returns the
    kernel's output."""
    options = dict(sliding_window=sliding_window, logit_cap=logit_cap)
    oracle = inputs.oracle(**options)
    out = inputs.run(**options)
    for name, got in (("kernel", out), ("reference", inputs.ref(**options))):
        err = rel_err(got, oracle)
        assert err < REL_TOL[torch.float32], f"{name} rows {rows} {options}: relative error {err:.2e}"
    return out


# each head size and each dtype with every other case; not all four pairs (each case is
# ~0.9 s in Triton's interpreter)
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (128, torch.float16)], ids=["64-f32", "128-f16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "prefix"])
def test_extend_mixed_batch(with_prefix: bool, group: int, head_dim: int, dtype: torch.dtype,
                            gen: torch.Generator) -> None:
    new = [1, 7, 96, 300] if not with_prefix else [1, 7, 96, 130]
    prefix = [0] * 4 if not with_prefix else [300, 1, 37, 64]
    run_extend(gen, shuffled(gen, list(zip(new, prefix))), group, head_dim, dtype)


@pytest.mark.parametrize("rows", [[(1, 0)] * 3, [(7, 0), (7, 5)], [(96, 0)], [(300, 0)], [(1, 300)]],
                         ids=["len1", "len7", "len96", "len300", "prefix300"])
def test_extend_uniform_lengths(rows: list[tuple[int, int]], gen: torch.Generator) -> None:
    run_extend(gen, rows, group=4, head_dim=64, dtype=torch.float32)


# Rows of (new tokens, prefix tokens) around the kernel's tiles (128 queries x
# 64 keys at head_dim <= 64): prefixes longer than the windows, a second query
# block (150 new tokens), a fresh prompt and a single decoding-like token.
WINDOW_ROWS = [(5, 200), (150, 70), (40, 0), (1, 90)]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [2, 33, 64, 129])
def test_extend_sliding_window_sees_only_the_last_window_tokens(window: int, group: int,
                                                                gen: torch.Generator) -> None:
    # windows shorter than the prefixes and than the longest row's new tokens,
    # one tile wide, and one past a query block
    rows = shuffled(gen, WINDOW_ROWS)
    check_gemma(extend_inputs(gen, rows, group, 16, torch.float32), rows, sliding_window=window)


def test_extend_window_of_one_is_each_tokens_own_value(gen: torch.Generator) -> None:
    rows = shuffled(gen, WINDOW_ROWS)
    inputs = extend_inputs(gen, rows, group=3, head_dim=16, dtype=torch.float32)
    out = check_gemma(inputs, rows, sliding_window=1)
    torch.testing.assert_close(out, inputs.v.repeat_interleave(3, dim=1), rtol=1e-5, atol=1e-5)


def test_extend_window_longer_than_every_row_is_full_attention(gen: torch.Generator) -> None:
    rows = shuffled(gen, WINDOW_ROWS)
    inputs = extend_inputs(gen, rows, group=4, head_dim=32, dtype=torch.float32)
    longest = max(n + p for n, p in rows)
    full = inputs.run()
    for window in (longest, 10_000):
        out = check_gemma(inputs, rows, sliding_window=window)
        assert rel_err(out, full) < 1e-6


@pytest.mark.parametrize("group", [1, 4])
def test_extend_logit_cap_squashes_scores_before_the_softmax(group: int, gen: torch.Generator) -> None:
    rows = shuffled(gen, [(1, 0), (7, 5), (70, 64), (130, 0)])
    # scores of several units against a cap of 2: the cap changes the result
    inputs = extend_inputs(gen, rows, group, 32, torch.float32, q_scale=4.0)
    out = check_gemma(inputs, rows, logit_cap=2.0)
    assert rel_err(out, inputs.oracle()) > 0.05, "the cap made no difference: the test is blind"


@pytest.mark.parametrize("group", [3, 4])
def test_extend_window_and_logit_cap_together(group: int, gen: torch.Generator) -> None:
    rows = shuffled(gen, WINDOW_ROWS)
    inputs = extend_inputs(gen, rows, group, 16, torch.float32, q_scale=4.0)
    check_gemma(inputs, rows, sliding_window=50, logit_cap=3.0)
