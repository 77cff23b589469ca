"""The per-token building blocks of the decoder, written for speed on a CPU.

`Linear` is a weight that is prepared once, after loading, for the device it
will run on. On a CPU (measured by `python -m bench.micro.linear_bench`:
bench/RESULTS.md, "The model's matmuls per kernel"):

- bfloat16 with AMX or AVX512_BF16: the native op (model_proc/native/
  layers.cpp): the weight packed once into brgemm's blocked layout, the
  epilogue (bias, residual add, SiLU(gate) * up) fused into the pass that
  rounds the product to bfloat16, the RMSNorm before it (`norm_eps`) in the
  same call, and the packed weights of the whole model in one buffer on
  transparent huge pages: faster than oneDNN from 1 row (a decode step
  alone) to 1024 (a prefill), and faster on huge pages than on 4 KiB ones.
- otherwise (float32, or no native op): a oneDNN pre-packed weight. MKL's
  float32 `F.linear` runs a single-row matmul on one thread; oneDNN's uses
  both and, pre-packed, reads the weight at close to the memory bandwidth
  (about half the time of MKL's for the whole model's matmuls). It fuses
  the residual add.

Everything else on a GPU (or without oneDNN) stays `F.linear` plus the same
epilogue as separate ops: same results up to float rounding.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_proc import native
from model_proc.parallel import SINGLE, TensorParallel, vocab_range
from model_proc.quant.weight import QuantWeight
from model_proc.row_blocks import in_row_blocks

# Batch-size hint oneDNN packs for. The packed layout serves any number of
# rows; 16 was as fast as any other hint at 1..128 rows in float32 and
# bfloat16, and clearly better than none in float32 (bench/RESULTS.md).
PACK_HINT_ROWS = 16


class MatmulKernel(Enum):
    """What a prepared `Linear` runs."""
    TORCH = "torch"      # F.linear on the plain weight (a GPU; no oneDNN)
    ONEDNN = "onednn"    # oneDNN's pre-packed weight
    NATIVE = "native"    # model_proc/native/layers.cpp's packed blocks
    QUANT = "quant"      # a GGUF file's own quantized blocks (model_proc/quant/)


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


# Switch for benchmarks and tests: False keeps every building block on torch.
use_native = True


def native_layers_op(device: torch.device, dtype: torch.dtype | None = torch.bfloat16):  # -> module or None
    """The native layer ops where they run here (on a CPU with AMX or
    AVX512_BF16, and a compiler; for tensors of `dtype`: bfloat16 only, or
    None for the ops that take float32 logits); None elsewhere or when
    switched off."""
    if not use_native or device.type != "cpu" or dtype not in (torch.bfloat16, None):
        return None
    op = native.load(name="layers")
    return op if op is not None and op.supported() else None


# the activation dtypes of native_step_ops' ops
STEP_OPS_DTYPES = (torch.bfloat16, torch.float32)


def native_step_ops(device: torch.device):  # -> module or None
    """The native layers module for the ops it runs on any CPU (rms_norm,
    rope_, finish: bfloat16 or float32, float32 inside; the quantized layers'
    steps and their DecoderStack), where it builds; None elsewhere or when
    switched off."""
    if not use_native or device.type != "cpu":
        return None
    return native.load(name="layers")


def pack_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / block), K / 2, block, 2]: per block of `block`
    output rows, the VNNI layout brgemm reads (pairs of K side by side);
    zero rows pad N."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % block))
    return w.view(-1, block, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def gated_halves_interleaved(blocks_g: torch.Tensor, blocks_u: torch.Tensor) -> torch.Tensor:
    """Gate block j, then up block j, ...: one task of the op holds both."""
    return torch.stack([blocks_g, blocks_u], 1).flatten(0, 1)


class HooklessModule(nn.Module):
    """A module whose call is its forward, without nn.Module's hook machinery.

    The decoder's per-layer modules are called ~210 times a decode step
    (30 layers of a layer, its attention, its MLP and four matmuls); the
    hook checks of nn.Module's call were a measurable share of a decode step
    at batch 1. Nothing registers hooks on these modules; the model's head
    keeps them."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class Linear(HooklessModule):
    """y = x @ W.T + b, optionally with a fused epilogue.

    Holds a plain `weight` [out, in] until `prepare` packs it (after the
    weights are loaded and any norm folded in). `gated`: the weight is gate
    and up stacked ([2 h, in]) and the output is SiLU(gate) * up ([T, h]),
    the MLP's activation. `add=t` in forward: y + t (the residual).
    """

    # class-wide switch, so a benchmark or test can compare the kernels (the
    # native one: the module's `use_native`)
    use_onednn = True
    # set by the model under --deterministic: calls of a fixed number of rows
    # (row_blocks.py), so that a row's bits do not depend on the batch
    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, bias: bool, gated: bool = False) -> None:
        super().__init__()
        # weights are filled by load_weights; no point initialising them
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.gated = gated
        self.rows = out_features  # of the weight: both halves when gated
        self.out_features = out_features // 2 if gated else out_features
        # the native kernel's output in float32, not rounded to the weight's
        # dtype (the LM head: logits are float32 from there on anyway)
        self.float_out = False
        self.kernel = MatmulKernel.TORCH
        self.packed: torch.Tensor | None = None  # oneDNN's, or the native op's blocks
        self.packed_bias: torch.Tensor | None = None  # the native op's: float32, in block order
        self.op = None
        self.quantized: QuantWeight | None = None  # set_quantized's

    def set_quantized(self, w: QuantWeight) -> None:
        """Run on quantized blocks instead of a float weight (the float one is dropped)."""
        self.quantized, self.kernel = w, MatmulKernel.QUANT
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)

    @torch.no_grad()
    def prepare(self) -> None:
        """Pack the weight for the fastest kernel here; the plain copy is then dropped."""
        if self.kernel is MatmulKernel.QUANT:
            # the blocks are the kernel's layout already; its steps take the
            # native norm and epilogue (_quantized_forward), as the DecoderStack does
            self.op = native_step_ops(self.weight.device)
            self.packed_bias = None if self.bias is None else self.bias.detach().float().contiguous()
            return
        w = self.weight.detach().contiguous()
        op = native_layers_op(w.device, w.dtype) if w.shape[1] % 2 == 0 else None
        if op is not None:
            self.op, self.kernel = op, MatmulKernel.NATIVE
            self.packed, self.packed_bias = self._native_blocks(w, op.block_columns)
        elif self.use_onednn and onednn_supports(w.device, w.dtype):
            self.kernel = MatmulKernel.ONEDNN
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS)
        else:
            return
        # the packed copy is all forward needs: don't hold the weight twice
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    def _native_blocks(self, w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = None if self.bias is None else self.bias.detach().float()
        if not self.gated:
            return pack_blocks(w, block), None if b is None else F.pad(b, (0, -b.shape[0] % block))
        h = self.out_features
        blocks = gated_halves_interleaved(pack_blocks(w[:h], block), pack_blocks(w[h:], block))
        if b is None:
            return blocks, None
        pad = -h % block
        halves = [F.pad(b[:h], (0, pad)).view(-1, block), F.pad(b[h:], (0, pad)).view(-1, block)]
        return blocks, torch.stack(halves, 1).flatten()

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None,
                norm_eps: float | None = None) -> torch.Tensor:
        """norm_eps: x is first RMS-normalized (`rms_norm`; the norm's weight
        is folded into this one), by the native op in the same call."""
        if self.kernel is MatmulKernel.NATIVE and x.stride(-1) == 1 and (add is None or add.stride(-1) == 1) \
                and not self.batch_invariant:
            # the common case first: a decode step makes ~120 of these calls
            return self.op.linear(x, self.packed, self.out_features, self.gated, self.packed_bias, add,
                                  self.float_out, -1.0 if norm_eps is None else norm_eps)
        if self.kernel is MatmulKernel.QUANT and self.op is not None and x.dtype in STEP_OPS_DTYPES \
                and not self.float_out and not self.batch_invariant:
            return self._quantized_forward(x, add, norm_eps)
        if norm_eps is not None:
            x = rms_norm(x, norm_eps)
        if self.batch_invariant:
            return in_row_blocks(self._forward, x, add)
        return self._forward(x, add)

    def _forward(self, x: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is MatmulKernel.NATIVE:
            if x.stride(-1) != 1:
                x = x.contiguous()
            if add is not None and add.stride(-1) != 1:
                add = add.contiguous()
            return self.op.linear(x, self.packed, self.out_features, self.gated, self.packed_bias, add,
                                  self.float_out)
        if self.kernel is MatmulKernel.ONEDNN:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if add is not None and not self.gated and x.dtype == torch.float32:
                # float32 fuses the add; the bfloat16 path adds unfused (as it did
                # before the native op became the bfloat16 kernel)
                return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.packed, self.bias, "add")
        elif self.kernel is MatmulKernel.QUANT:
            y = self._quantized_product(x)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.gated:
            h = self.out_features
            # in place in the matmul's output: no new [T, h] tensors
            y = F.silu(y[:, :h], inplace=True).mul_(y[:, h:])
        if add is not None:
            y += add
        return y


    def _quantized_forward(self, x: torch.Tensor, add: torch.Tensor | None,
                           norm_eps: float | None) -> torch.Tensor:
        """x (bfloat16 or float32) on quantized blocks: the native norm, the product
        (QuantWeight.matmul, float32) and the native epilogue (bias, SiLU(gate)
        * up, the residual; float32 inside, rounded once): the ops and order
        of layers.cpp's DecoderStack on quantized layers, so the same bits."""
        assert self.quantized is not None
        if norm_eps is not None:
            x = self.op.rms_norm(x if x.stride(-1) == 1 else x.contiguous(), norm_eps)
        y = self.quantized.matmul(x)
        if add is not None and add.stride(-1) != 1:
            add = add.contiguous()
        return self.op.finish(y, self.out_features, self.gated, self.packed_bias, add, x.dtype)

    def _quantized_product(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quantized is not None
        y = self.quantized.matmul(x)  # float32
        if y.shape[1] < self.rows:  # the last rank's slice of a padded vocabulary
            y = F.pad(y, (0, self.rows - y.shape[1]))
        if self.bias is not None:
            y += self.bias
        return y if self.float_out else y.to(x.dtype)


def move_packed_onto_huge_pages(linears: list[Linear]) -> int:
    """Put the native op's packed weights of `linears` into one buffer on
    transparent huge pages (native.huge_page_buffer); returns its bytes.
    One buffer, not one per weight: a huge page is 2 MiB and most weights
    are smaller. Every decode step streams all the weights from memory, and
    the whole model's matmuls (`python -m bench.micro.linear_bench`) ran
    faster on them (weights on 4 KiB pages: a TLB miss and a restart of the
    hardware prefetcher every 4 KiB)."""
    moving = [lin for lin in linears if lin.kernel is MatmulKernel.NATIVE]
    align = 64  # a cache line: brgemm's loads stay aligned

    def size(t: torch.Tensor) -> int:
        return (t.numel() * t.element_size() + align - 1) // align * align

    total = sum(size(lin.packed) for lin in moving)
    if total == 0:
        return 0
    buf, at = native.huge_page_buffer(total), 0
    for lin in moving:
        old = lin.packed
        n = old.numel() * old.element_size()
        lin.packed = buf[at:at + n].view(old.dtype).view(old.shape).copy_(old)
        at += size(old)
    return total


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

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
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
        self.quantized: QuantWeight | None = None  # set_quantized's

    def set_quantized(self, w: QuantWeight) -> None:
        """Look rows up in quantized blocks (dequantizing only those rows)."""
        self.quantized = w
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        return self.quantized.dequantize_rows(ids).to(self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        outside = (ids < self.start) | (ids >= self.end)
        x = self._lookup((ids - self.start).masked_fill_(outside, 0))
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
        self.float_out = True

    # called once a step: it keeps nn.Module's call, hooks included (tests watch its input)
    __call__ = nn.Module.__call__

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None,
                norm_eps: float | None = None) -> torch.Tensor:
        assert add is None, "nothing is added to logits"
        logits = super().forward(x, norm_eps=norm_eps)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, :self.vocab_size]


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight: the weight is folded into the next matmul.

    In bfloat16 on a CPU, the native op (one pass, float32 inside). Otherwise
    torch's rms_norm, which computes in float32 for a bfloat16 input, as
    transformers' RMSNorm does after its explicit upcast (bit-identical,
    tested), so the model needs no `.float()` / `.to(dtype)` of its own.
    """
    op = native_layers_op(x.device, x.dtype)
    if op is not None and x.stride(-1) == 1:
        return op.rms_norm(x, eps)
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm of each head in place, then its weight (Qwen3's q/k norms).

    x [T, heads, D] (a view into the fused qkv output), weight [heads, D]:
    each head's row of its norm's weight. torch's rms_norm computes in
    float32 and rounds to x's dtype, then the weight multiplies, as
    transformers' RMSNorm does; no weight to fold here, since rotary follows.
    """
    x.copy_(F.rms_norm(x, (x.shape[-1],), eps=eps).mul_(weight))


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op: Any = None) -> None:
    """Rotary embedding in place, rotate-half layout.

    x [T, heads, D] (a view into the fused qkv output, q and k heads side by
    side, so both get one pass); cos/sin [T, 1, D/2]: the table's two halves
    are equal, so only one is kept. With x = (x1, x2):
    x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin. In bfloat16 on a CPU, the
    native op (float32 inside, rounded once); else five torch ops. `op`:
    the native module to take whatever the CPU (native_step_ops: quantized
    layers rotate as their DecoderStack does).
    """
    op = op or native_layers_op(x.device, x.dtype)
    if op is not None and x.dtype in STEP_OPS_DTYPES and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous():
        op.rope_(x, cos, sin)
        return
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
