"""The per-token building blocks of the decoder, written for speed on a CPU.

`Linear` is a weight that is prepared once, after loading, for the device it
will run on; on a CPU it becomes a oneDNN pre-packed weight, because
measured on this project's 2-core AVX-512 machine (bench/RESULTS.md):

- MKL's float32 `F.linear` runs a single-row (decode at batch 1) matmul on
  one thread; oneDNN's uses both and, pre-packed, reads the weight at close
  to the memory bandwidth (the whole model's matmuls: ~21 ms vs ~43 ms).
- pre-packing (the blocked layout oneDNN wants) is done once instead of on
  every call, and oneDNN can fuse the epilogue that follows the matmul: the
  residual add, SiLU, the gate * up product. One dispatch instead of two or
  three matters at batch 1, where a layer is ~15 small ops.

Everything else on a GPU (or without oneDNN) stays `F.linear` plus the same
epilogue as separate ops: same results up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_proc.batch_invariant import in_row_blocks
from model_proc.parallel import SINGLE, TensorParallel, vocab_range

# Batch-size hint oneDNN packs for. The packed layout serves any number of
# rows; 16 was as fast as any other hint at 1..128 rows in float32 and
# bfloat16, and clearly better than none in float32 (bench/RESULTS.md).
PACK_HINT_ROWS = 16


def onednn_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `Linear` can pre-pack for oneDNN here."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        # avx512_bf16 / AMX; without them oneDNN emulates bf16, slower than float32
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class Linear(nn.Module):
    """y = x @ W.T + b, optionally followed by a fused epilogue.

    Holds a plain `weight` [out, in] until `prepare` packs it (after the
    weights are loaded and any norm folded in). Epilogues: `act="silu"`,
    `add=t` (y + t, the residual), `mul=t` (y * t).
    """

    # class-wide switch, so a benchmark can compare against plain F.linear
    use_onednn = True
    # set by the model under --deterministic: calls of a fixed number of rows
    # (batch_invariant.py), so that a row's bits do not depend on the batch
    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        # weights are filled by load_weights; no point initialising them
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    @torch.no_grad()
    def prepare(self) -> None:
        """Pack the weight for oneDNN when it pays; the plain copy is then dropped."""
        w = self.weight
        if self.use_onednn and onednn_supports(w.device, w.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT_ROWS)
            # the packed copy is all forward needs: don't hold the weight twice
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    def forward(self, x: torch.Tensor, act: str = "", add: torch.Tensor | None = None,
                mul: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant:
            return in_row_blocks(self._forward, x, act, add, mul)
        return self._forward(x, act, add, mul)

    def _forward(self, x: torch.Tensor, act: str, add: torch.Tensor | None,
                 mul: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self._onednn(x, act, add, mul)
        y = F.linear(x, self.weight, self.bias)
        if act == "silu":
            y = F.silu(y, inplace=True)
        if add is not None:
            y += add
        if mul is not None:
            y *= mul
        return y

    def _onednn(self, x: torch.Tensor, act: str, add: torch.Tensor | None,
                mul: torch.Tensor | None) -> torch.Tensor:
        if (add is not None or mul is not None) and x.dtype != torch.float32:
            # bfloat16 keeps the add unfused. It was unfused when the default
            # model answered "What is the capital of France?" wrongly, but
            # that prompt's first token is a near tie (float32 margin 0.08):
            # measured later, the fused add's logits were no further from
            # float32 than these, nor than transformers' bfloat16
            # (tests/model_proc/test_default_model.py). float32 fuses.
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y.add_(add) if add is not None else y.mul_(mul)
        if add is not None or mul is not None:
            assert not act, "one epilogue at a time"
            other, kind = (add, "add") if add is not None else (mul, "mul")
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, kind)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias,
                                                  "swish" if act == "silu" else "none", [], "")


# ---- tensor-parallel pieces (model_proc/parallel.py) ------------------------------------
# A column-parallel matmul (fused q/k/v, gate/up) is a plain `Linear` holding
# this rank's output rows: its output feeds this rank's heads or MLP slice
# directly, no communication. The two layers below are the ones that talk.


class RowParallelLinear(Linear):
    """o_proj / down_proj: each rank holds the weight's columns for its own
    heads (or MLP slice) and computes a partial product; one all-reduce sums
    them. The bias and the residual are added on rank 0 only (fused into its
    epilogue, as at size 1), so the sum counts them once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias and tp.is_first)
        self.tp = tp

    def forward(self, x: torch.Tensor, act: str = "", add: torch.Tensor | None = None,
                mul: torch.Tensor | None = None) -> torch.Tensor:
        assert not act and mul is None, "a row-parallel output is partial until the all-reduce"
        if self.tp.size == 1:
            return super().forward(x, add=add)
        return self.tp.all_reduce_(super().forward(x, add=add if self.tp.is_first else None))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: a rank looks up the ids
    in its slice, zeros for the rest, and an all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end, rows = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding((ids - self.start).masked_fill_(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce_(x)


class ParallelLMHead(Linear):
    """The LM head split by vocabulary rows: each rank computes its slice of
    the logits and an all-gather puts the whole row on every rank before
    sampling. The last slice's padding rows (vocab not a multiple of the
    ranks) are zero and cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = SINGLE) -> None:
        self.start, self.end, rows = vocab_range(vocab_size, tp.rank, tp.size)
        super().__init__(hidden_size, rows, bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, x: torch.Tensor, act: str = "", add: torch.Tensor | None = None,
                mul: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, :self.vocab_size]


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight: the weight is folded into the next matmul.

    torch's rms_norm computes in float32 for a bfloat16 input, as transformers'
    RMSNorm does after its explicit upcast (bit-identical, tested), so the
    model needs no `.float()` / `.to(dtype)` of its own around it.
    """
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place, rotate-half layout.

    x [T, heads, D] (a view into the fused qkv output, q and k heads side by
    side, so both get one pass); cos/sin [T, 1, D/2]: the table's two halves
    are equal, so only one is kept. With x = (x1, x2):
    x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_old = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).addcmul_(x1_old, sin)


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """W @ diag(g): a linear after an RMSNorm with weight g, as one matrix.

    Computed in float32 and rounded once into the model dtype. In float32 the
    product differs from the unfused norm-then-matmul by float rounding only.
    """
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype)
