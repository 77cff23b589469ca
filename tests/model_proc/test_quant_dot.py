"""The 8-bit-activation kernels (model_proc/native/quant_dot.cpp, model_proc/quant/int8_act.py):
the AVX2 and scalar paths bit for bit equal, the product against a float64
one of the same quantized x and gguf-py's dequantized weight, against the
float x within the 8-bit rounding's bound, and their refusals of bad input."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from model_proc import native
from model_proc.quant import int8_act
from model_proc.quant.ggml_types import GGMLType, block_shape, row_bytes
from model_proc.quant.int8_act import Q8_ROUNDING, Q8_TYPES, Q8Rows, quant_matmul_q8, quantize_rows
from tests.model_proc.gguf_blocks import bits, gguf_reference, on_native_path, quantized_blocks, random_blocks

op = native.load(name="quant_dot")
pytestmark = pytest.mark.skipif(op is None, reason=f"native quant_dot op not built: {native.failure('quant_dot')}")

TYPES = sorted(Q8_TYPES)
N = 37  # odd: the row tiles' tails
QUANTIZABLE = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0}  # gguf-py quantizes these


def width(qtype: GGMLType) -> int:
    """k: 576 (18 blocks of 32: a short last group of 8) or 512 (two K-quant blocks)."""
    return 576 if block_shape(qtype)[0] == 32 else 512


def weight_cases(qtype: GGMLType, k: int) -> list[np.ndarray]:
    found = [random_blocks(qtype, N, k, seed=int(qtype), subnormal=False)]
    if qtype in QUANTIZABLE:  # as a converter writes them
        found.append(quantized_blocks(qtype, N, k, seed=100 + int(qtype)))
    return found


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """x of LLM scale: normal, a few outlier channels 20x, one block all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (k // 64,), generator=g)] *= 20
    x[0, 32:64] = 0.0
    return x


@pytest.fixture(params=["simd", "scalar"])
def native_path(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from on_native_path(op, "quant_dot", request.param)


def both_paths(fn):
    """fn() on the AVX2 path, then on the scalar one."""
    try:
        op.set_simd(True)
        a = fn()
        op.set_simd(False)
        return a, fn()
    finally:
        op.set_simd(True)


def test_quantize_rows_layout_and_rounding() -> None:
    x = activations(3, 96, seed=1)
    x[1, :4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # the block's max 127: d = 1, ties to even
    x[1, 4:32] = 0.0
    rows = quantize_rows(x)
    assert rows.q.shape == (3, 256) and rows.q.dtype == torch.int8 and rows.k == 96
    assert rows.d.shape == rows.s.shape == (3, 8) and rows.bsum.shape == (3, 16) and rows.bsum.dtype == torch.int16
    assert rows.q[1, :4].tolist() == [127, -64, 0, 2] and rows.d[1, 0].item() == 1.0
    assert (rows.q[:, 96:] == 0).all() and (rows.d[:, 3:] == 0).all() and (rows.bsum[:, 6:] == 0).all()
    assert (rows.q[0, 32:64] == 0).all() and rows.d[0, 1].item() == 0.0  # an all-zero block
    assert rows.q.abs().max().item() <= 127
    blocks = x.view(3, 3, 32)
    assert torch.equal(rows.d[:, :3], blocks.abs().amax(-1) / 127)
    q = rows.q[:, :96].int().view(3, 6, 16)
    assert torch.equal(rows.bsum[:, :6].int(), q.sum(-1))
    assert torch.equal(rows.s[:, :3], rows.d[:, :3] * q.view(3, 3, 32).sum(-1).float())
    # each value within half a step (and float32's rounding of x / d) of x
    err = (rows.dequantize() - x).abs().view(3, 3, 32)
    assert (err <= Q8_ROUNDING * rows.d[:, :3, None]).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_and_scalar_paths_agree_bit_for_bit(qtype: GGMLType) -> None:
    if not op.simd():
        pytest.skip("this build has no AVX2 path")
    k = width(qtype)
    for m in (1, 5, 9):  # one tile of 4 x rows, a tile and a tail, two and a tail
        x = activations(m, k, seed=m)
        ra, rb = both_paths(lambda: quantize_rows(x))
        for a, b in zip(ra[:4], rb[:4]):
            assert torch.equal(a, b)
        for raw in weight_cases(qtype, k):
            blocks = torch.from_numpy(raw)
            ya, yb = both_paths(lambda: int8_act.matmul_q8(ra, blocks, qtype))
            assert torch.equal(bits(ya), bits(yb))
            assert torch.equal(bits(op.matmul_q8(x, blocks, int(qtype))), bits(ya))  # quantize and gemv in one


# Against the float64 product of the same quantized x (q * d, exact in float64)
# and gguf-py's weight: the kernel's float32 work is P = f * d_x, one FMA per
# 4 products' integer sum, the offsets, and the sum of 16 lanes: a few float32
# roundings (eps 6e-8) of the terms' magnitudes. Bounded by 1e-6 of
# sum |x_q| |w|: the errors measured are ~5e-8 of it; a wrong code, scale or
# offset is off by 1e-3 or more.
Q8_TOL = 1e-6


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tol: float) -> None:
    x64, w64 = x.double(), w.double()
    scale = x64.abs() @ w64.abs().T
    err = (y.double() - x64 @ w64.T).abs()
    assert (err <= tol * scale + 1e-30).all(), f"max error / scale {(err / scale).max().item():.2e}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_the_float64_product_of_the_quantized_x(qtype: GGMLType, native_path: str) -> None:
    k = width(qtype)
    x = activations(6, k, seed=11)
    rows = quantize_rows(x)
    for raw in weight_cases(qtype, k):
        y = int8_act.matmul_q8(rows, torch.from_numpy(raw), qtype)
        assert y.shape == (6, N) and y.dtype == torch.float32
        assert_close(y, rows.dequantize(), gguf_reference(raw, qtype), Q8_TOL)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_slices_of_a_weight_are_weights(qtype: GGMLType) -> None:
    """Row slices, strided rows and block-aligned column slices give the
    product with that slice of the weight."""
    k = width(qtype)
    raw = random_blocks(qtype, N, 2 * k, seed=7)
    whole = gguf_reference(raw, qtype)
    blocks = torch.from_numpy(raw)
    half = row_bytes(qtype, k)
    x = activations(3, k, seed=3)
    rows = quantize_rows(x)
    for part, w in ((blocks[:, half:], whole[:, k:]), (blocks[3:11, :half], whole[3:11, :k]),
                    (blocks[::2, :half], whole[::2, :k])):
        assert_close(int8_act.matmul_q8(rows, part, qtype), rows.dequantize(), w, Q8_TOL)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_against_the_float_x_within_the_8_bit_rounding(qtype: GGMLType, dtype: torch.dtype) -> None:
    """|y - x @ W.T| <= Q8_ROUNDING * sum_b d_b sum_{i in b} |W_i| (each x
    value moves by at most half its block's step d_b) plus float32's own
    error (1e-6 of sum |x| |W|, as above); a bfloat16 x gives the float32
    result rounded once."""
    k = width(qtype)
    x = activations(4, k, seed=5).to(dtype)
    raw = weight_cases(qtype, k)[-1]
    blocks, w = torch.from_numpy(raw), gguf_reference(raw, qtype).double()
    y = quant_matmul_q8(x, blocks, qtype, k)
    assert y.shape == (4, N) and y.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(y, quant_matmul_q8(x.float(), blocks, qtype, k).to(dtype))
        return
    rows = quantize_rows(x)
    step = rows.d[:, :k // 32].double()  # [M, blocks]
    w_abs = w.abs().view(N, k // 32, 32).sum(-1)  # [N, blocks]
    bound = Q8_ROUNDING * step @ w_abs.T + Q8_TOL * (x.double().abs() @ w.abs().T)
    err = (y.double() - x.double() @ w.T).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.3f}"
    assert (err / bound).max() > 1e-3  # the bound is of the error's order, not vacuous


def test_bad_input_is_refused_with_its_reason() -> None:
    k = 512
    blocks = torch.from_numpy(random_blocks(GGMLType.Q4_K, 4, k, seed=3))
    rows = quantize_rows(torch.zeros(2, k))
    with pytest.raises(ValueError, match="has no 8-bit-activation kernel"):
        quant_matmul_q8(torch.zeros(2, k), blocks, GGMLType.Q5_K, k)
    with pytest.raises(ValueError, match="unsupported GGML type 99"):
        quant_matmul_q8(torch.zeros(2, k), blocks, 99, k)
    with pytest.raises(ValueError, match=r"x must be float32 or bfloat16 \[M, 512\]"):
        quant_matmul_q8(torch.zeros(2, k, dtype=torch.float64), blocks, GGMLType.Q4_K, k)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quantize_rows(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="288 bytes a row; k = 256 needs 144"):
        quant_matmul_q8(torch.zeros(2, 256), blocks, GGMLType.Q4_K, 256)
    with pytest.raises(ValueError, match="k = 288 is not a positive multiple of the type's 256"):
        op.gemv_q8(*rows[:4], blocks, int(GGMLType.Q4_K), 288)
    with pytest.raises(ValueError, match="unsupported GGML type 13 for 8-bit activations"):
        op.gemv_q8(*rows[:4], blocks, int(GGMLType.Q5_K), k)
    with pytest.raises(ValueError, match=r"q must be quantize_rows' contiguous int8 \[M, 768\] for k = 544"):
        int8_act.matmul_q8(Q8Rows(*rows[:4], 544), torch.from_numpy(random_blocks(GGMLType.Q4_0, 4, 544, 1)),
                           GGMLType.Q4_0)
    with pytest.raises(ValueError, match=r"d must be quantize_rows' contiguous Float \[2, 16\]"):
        op.gemv_q8(rows.q, rows.d[:1], rows.s, rows.bsum, blocks, int(GGMLType.Q4_K), k)
    with pytest.raises(ValueError, match="bsum must be"):
        op.gemv_q8(rows.q, rows.d, rows.s, rows.bsum.int(), blocks, int(GGMLType.Q4_K), k)
    with pytest.raises(ValueError, match="uint8"):
        op.gemv_q8(*rows[:4], blocks.view(torch.int8), int(GGMLType.Q4_K), k)
    with pytest.raises(ValueError, match="contiguous float32"):
        op.quantize_rows(torch.zeros(2, k, dtype=torch.float64))
    assert int8_act.available() and int8_act.available(GGMLType.Q6_K) and not int8_act.available(GGMLType.Q5_K)
    assert not int8_act.supports(99) and all(op.supports(int(t)) for t in TYPES) and not op.supports(13)
