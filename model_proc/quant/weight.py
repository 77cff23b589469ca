"""A matmul weight kept in GGUF's quantized blocks (`QuantWeight`), and the
operations the loader needs on it: row and column slices (tensor
parallelism), row concatenation (fused q/k/v and gate/up), a norm's weight
carried as an input scale, and the matmul itself.

The blocks are the file's own bytes: a weight [N, K] is N rows of K / B
blocks of B weights each (ggml_types.block_shape), so a row slice, or a
column slice on block boundaries, is still a valid weight. A fused weight
may mix block types (a Q4_K_M file stores some layers' v_proj as Q6_K and
their q/k_proj as Q4_K): it is then a list of segments, each run by its
type's kernel into its own columns of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_proc.quant import int8_act
from model_proc.quant.ggml_types import GGMLType, block_shape, row_bytes
from model_proc.quant.matmul import dequantize, quant_matmul

# Up to this many rows x is rounded to 8-bit blocks once and every segment
# dotted with it in integers (int8_act.py, as llama.cpp and vLLM's GGUF
# kernels do): one thread, Q4_0, 1.2-1.6x the float gemv's speed at one row
# (576 x 576 to 49152 x 2048), 1.6-1.7x at 16 rows, 1.1-1.3x the dequantized
# tiles at 32 (python -m bench.micro.quant_bench --paths gemv tiles q8).
# Above, the dequantized tiles' float32 product with x rounded the same way
# (q * d, the values the integer kernel multiplies), so a prefill's products
# and a decode step's take the same arithmetic (llama.cpp's way). A type
# without such a kernel (Q5_0, Q5_1, Q5_K) keeps float x in every product.
Q8_MAX_ROWS = 32
# Off by default (ServerArgs.quantize_activations; the model process sets it
# from ServerArgs.int8_activations; tests and benchmarks switch it): the
# rounding turns last-bit differences between two attention paths into whole
# steps near a rounding boundary, so a prefill's and a decode step's logprobs
# may differ by far more than float rounding (docs/architecture.md).
use_q8_activations = False


@dataclass(frozen=True)
class QuantSegment:
    """Consecutive output rows of one block type: blocks [rows, row_bytes] uint8."""
    qtype: GGMLType
    blocks: torch.Tensor

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


@dataclass
class QuantWeight:
    """W [N, K] as quantized segments stacked by rows. `input_scale` [K]
    (float32): y = (x * input_scale) @ W.T; the RMSNorm weight before this
    matmul, which cannot be folded into quantized blocks as it is into a
    float weight (layers.fold_norm_weight)."""
    segments: list[QuantSegment]
    in_features: int
    input_scale: torch.Tensor | None = field(default=None)

    def __post_init__(self) -> None:
        for s in self.segments:
            if s.blocks.dtype != torch.uint8 or s.blocks.dim() != 2 \
                    or s.blocks.shape[1] != row_bytes(s.qtype, self.in_features):
                raise ValueError(f"{s.qtype.name} blocks {tuple(s.blocks.shape)} ({s.blocks.dtype}) do not hold "
                                 f"rows of {self.in_features} weights")

    @classmethod
    def of(cls, qtype: GGMLType, blocks: torch.Tensor, in_features: int) -> QuantWeight:
        return cls([QuantSegment(qtype, blocks)], in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.rows for s in self.segments), self.in_features

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)

    def rows(self, start: int, end: int) -> QuantWeight:
        """Output rows [start, end)."""
        out, at = [], 0
        for s in self.segments:
            a, b = max(start - at, 0), min(end - at, s.rows)
            if a < b:
                out.append(QuantSegment(s.qtype, s.blocks[a:b]))
            at += s.rows
        return QuantWeight(out, self.in_features, self.input_scale)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows in the order of `index` (a single-type weight): the reverse of
        llama.cpp's q/k row permutation."""
        if len(self.segments) != 1:
            raise ValueError("take_rows needs a single-type weight")
        s = self.segments[0]
        return QuantWeight([QuantSegment(s.qtype, s.blocks[index].contiguous())], self.in_features,
                           self.input_scale)

    def columns(self, start: int, end: int) -> QuantWeight:
        """Input columns [start, end) (a row-parallel shard): whole blocks only."""
        out = []
        for s in self.segments:
            per, nbytes = block_shape(s.qtype)
            if start % per or end % per:
                raise ValueError(f"a {s.qtype.name} weight splits only on its {per}-weight blocks: columns "
                                 f"[{start}, {end}) do not (choose a --tp-size that divides the blocks)")
            out.append(QuantSegment(s.qtype, s.blocks[:, start // per * nbytes:end // per * nbytes].contiguous()))
        scale = None if self.input_scale is None else self.input_scale[start:end]
        return QuantWeight(out, end - start, scale)

    @staticmethod
    def cat(weights: list[QuantWeight]) -> QuantWeight:
        """Stacked by rows (the parts of a fused q/k/v or gate/up)."""
        k = weights[0].in_features
        if any(w.in_features != k or w.input_scale is not None for w in weights):
            raise ValueError("only unscaled weights of one input width are stacked")
        segments: list[QuantSegment] = []
        for s in (s for w in weights for s in w.segments):
            if segments and segments[-1].qtype is s.qtype:  # one kernel call for a run of one type
                segments[-1] = QuantSegment(s.qtype, torch.cat([segments[-1].blocks, s.blocks]))
            else:
                segments.append(s)
        return QuantWeight(segments, k)

    def scaled_input(self, scale: torch.Tensor) -> QuantWeight:
        return QuantWeight(self.segments, self.in_features, scale.float())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(x * input_scale) @ W.T in float32: x [M, K] -> [M, N] (x rounded to
        8-bit blocks first where use_q8_activations and every segment has an
        integer kernel: see Q8_MAX_ROWS)."""
        x = x.float() if self.input_scale is None else x.float() * self.input_scale
        if use_q8_activations and self.q8_ready():
            if x.shape[0] > Q8_MAX_ROWS:  # the tiles below, on the x the integer kernel would take
                x = int8_act.quantize_rows(x).dequantize()
            elif len(self.segments) == 1:  # quantized and multiplied in one native call
                s = self.segments[0]
                return int8_act.quant_matmul_q8(x, s.blocks, s.qtype, self.in_features)
            else:
                rows = int8_act.quantize_rows(x)  # once, for every segment
                return torch.cat([int8_act.matmul_q8(rows, s.blocks, s.qtype) for s in self.segments], 1)
        if len(self.segments) == 1:
            s = self.segments[0]
            return quant_matmul(x, s.blocks, s.qtype, self.in_features)
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32, device=x.device)
        at = 0
        for s in self.segments:
            out[:, at:at + s.rows] = quant_matmul(x, s.blocks, s.qtype, self.in_features)
            at += s.rows
        return out

    def q8_ready(self) -> bool:
        return all(int8_act.available(s.qtype) for s in self.segments)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows of W (an embedding lookup), input scale not applied."""
        if len(self.segments) != 1:
            raise ValueError("an embedding table is a single-type weight")
        s = self.segments[0]
        return dequantize(s.blocks[index], s.qtype, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in float32 (tests; the input scale not applied)."""
        return torch.cat([dequantize(s.blocks, s.qtype, self.in_features) for s in self.segments])
