"""The CPU-tuned building blocks equal their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_proc import layers
from model_proc.layers import (Linear, MatmulKernel, apply_rope_, fold_norm_weight, native_layers_op,
                               onednn_supports, rms_norm)

CPU = torch.device("cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


KERNELS = [MatmulKernel.NATIVE, MatmulKernel.ONEDNN, MatmulKernel.TORCH]
# the native matmul is bfloat16 only: no float32 case to run
KERNEL_DTYPES = [(k, d) for k in KERNELS for d in (torch.float32, torch.bfloat16)
                 if not (k is MatmulKernel.NATIVE and d == torch.float32)]
NEEDS_NATIVE = "needs AVX512_BF16 or AMX and a C++ compiler (model_proc/native/layers.cpp)"


def kernel_runs_here(kernel: MatmulKernel, dtype: torch.dtype) -> bool:
    if kernel is MatmulKernel.NATIVE:
        return native_layers_op(CPU, dtype) is not None
    return kernel is MatmulKernel.TORCH or onednn_supports(CPU, dtype)


def make_linear(dtype: torch.dtype, gen: torch.Generator, bias: bool, kernel: MatmulKernel, gated: bool,
                monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int] = (80, 48),
                ) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    if not kernel_runs_here(kernel, dtype):
        pytest.skip(f"no {kernel.value} matmul for {dtype} on this CPU: "
                    + (NEEDS_NATIVE if kernel is MatmulKernel.NATIVE else "needs oneDNN with bfloat16"))
    monkeypatch.setattr(layers, "use_native", kernel is MatmulKernel.NATIVE)
    monkeypatch.setattr(Linear, "use_onednn", kernel is MatmulKernel.ONEDNN)
    out, k = shape
    lin = Linear(k, out, bias=bias, gated=gated).to(dtype)
    w = (torch.randn(out, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    lin.prepare()
    assert lin.kernel is kernel
    return lin, w, b


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("out", [80, 140, 170, 340])
def test_linear_and_its_epilogues_equal_plain_torch(dtype, kernel, bias, gated, out, monkeypatch):
    """Widths that are not a multiple of the native op's 64-column blocks
    (per gated half: 40, 70, 85, 170), among them odd numbers of blocks (an
    uneven share between 2 threads) and last blocks under half full (140);
    rows across its tile sizes (1 row; 64; 300 in tiles of 128 with a short
    last one)."""
    gen = torch.Generator().manual_seed(0)
    lin, w, b = make_linear(dtype, gen, bias, kernel, gated, monkeypatch, shape=(out, 48))
    with torch.inference_mode():
        for rows in (1, 7, 33, 64, 300):
            # a strided input, as the MLP's in-place gate * up view is
            x = torch.randn(rows, 96, generator=gen).to(dtype)[:, ::2]
            full = F.linear(x.float(), w.float(), None if b is None else b.float())
            ref = F.silu(full[:, :out // 2]) * full[:, out // 2:] if gated else full
            other = torch.randn(*ref.shape, generator=gen).to(dtype)
            torch.testing.assert_close(lin(x).float(), ref, **TOL[dtype])
            torch.testing.assert_close(lin(x, add=other).float(), ref + other.float(), **TOL[dtype])
            assert lin(x).dtype == dtype and lin(x).shape == ref.shape


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_linear_with_norm_eps_equals_rms_norm_then_linear(dtype, kernel, gated, monkeypatch):
    """The norm fused into the matmul's call (the native op normalizes the
    rows in its own parallel region) gives the bits of rms_norm then the matmul,
    for contiguous and strided inputs, across row tiles."""
    gen = torch.Generator().manual_seed(3)
    lin, _w, _b = make_linear(dtype, gen, True, kernel, gated, monkeypatch, shape=(340, 96))
    with torch.inference_mode():
        for rows in (1, 7, 65, 300):
            wide = (torch.randn(rows, 192, generator=gen) * 3).to(dtype)
            for x in (wide[:, :96], wide[:, ::2], wide[:, :96].contiguous()):
                assert torch.equal(lin(x, norm_eps=1e-5), lin(rms_norm(x, 1e-5))), (rows, x.stride())


@pytest.mark.parametrize("kernel", [MatmulKernel.NATIVE, MatmulKernel.ONEDNN], ids=lambda k: k.value)
def test_packing_drops_the_plain_weight(kernel, monkeypatch):
    lin, _w, _b = make_linear(torch.bfloat16, torch.Generator().manual_seed(1), False, kernel, False, monkeypatch)
    assert lin.weight.numel() == 0 and lin.packed is not None


def test_packed_weights_move_onto_one_huge_page_buffer_unchanged(monkeypatch):
    """move_packed_onto_huge_pages: every native weight becomes a view of one
    buffer starting on a 2 MiB boundary, each at a cache-line offset, with
    the same outputs; a oneDNN weight stays where it is."""
    gen = torch.Generator().manual_seed(2)
    natives = [make_linear(torch.bfloat16, gen, bias, MatmulKernel.NATIVE, gated, monkeypatch, shape=shape)[0]
               for bias, gated, shape in ((False, False, (80, 48)), (True, True, (340, 96)), (False, False, (64, 576)))]
    onednn = make_linear(torch.bfloat16, gen, False, MatmulKernel.ONEDNN, False, monkeypatch)[0]
    xs = [torch.randn(5, lin.packed.shape[1] * 2, generator=gen).to(torch.bfloat16) for lin in natives]
    with torch.inference_mode():
        before = [lin(x) for lin, x in zip(natives, xs)]
        kept = onednn.packed
        total = layers.move_packed_onto_huge_pages(natives + [onednn])
        after = [lin(x) for lin, x in zip(natives, xs)]
    storage = natives[0].packed.untyped_storage().data_ptr()
    base = min(lin.packed.data_ptr() for lin in natives)
    assert base % (2 << 20) == 0 and total >= sum(lin.packed.nbytes for lin in natives)
    for lin in natives:
        assert lin.packed.untyped_storage().data_ptr() == storage and (lin.packed.data_ptr() - base) % 64 == 0
    assert onednn.packed is kept
    for b, a in zip(before, after):
        assert torch.equal(b, a)


@pytest.mark.skipif(native_layers_op(torch.device("cpu")) is None, reason="needs the native layer ops (AMX or AVX512_BF16)")
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_native_amx_loop_equals_brgemm_bit_for_bit(gated, monkeypatch):
    """17-64 rows take the op's own AMX loop where the CPU has AMX (brgemm
    elsewhere): the same products in the same order, so the same bits as
    brgemm, with a short last row tile (a padded copy), a fused norm, bias
    and residual, widths that are not whole blocks, and a K of two whole
    chunks of 256 and a part of one (96: an odd number of K steps)."""
    op = native_layers_op(torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    lin, _w, _b = make_linear(torch.bfloat16, gen, True, MatmulKernel.NATIVE, gated, monkeypatch, shape=(340, 608))
    with torch.inference_mode():
        for rows in (16, 17, 31, 32, 40, 48, 49, 63, 64, 65):
            x = torch.randn(rows, 2 * 608, generator=gen).to(torch.bfloat16)[:, :608]
            add = torch.randn(rows, lin.out_features, generator=gen).to(torch.bfloat16)
            try:
                op.set_amx(False)
                want = lin(x, add=add, norm_eps=1e-5), lin(x)
            finally:
                op.set_amx(True)
            got = lin(x, add=add, norm_eps=1e-5), lin(x)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), rows


def test_native_linear_rows_do_not_depend_on_their_mates(monkeypatch):
    """A row's bits at a fixed number of rows do not depend on the other rows
    (what --deterministic's fixed-size calls rely on, model_proc/row_blocks.py)."""
    gen = torch.Generator().manual_seed(5)
    lin, _w, _b = make_linear(torch.bfloat16, gen, True, MatmulKernel.NATIVE, True, monkeypatch, shape=(3072, 576))
    x = torch.randn(16, 576, generator=gen).to(torch.bfloat16)
    y = torch.randn(16, 576, generator=gen).to(torch.bfloat16)
    y[3] = x[3]
    with torch.inference_mode():
        assert torch.equal(lin(x)[3], lin(y)[3])


def test_rope_in_place_equals_rotate_half():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, 16, generator=gen)
    angles = torch.randn(5, 1, 8, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated = torch.cat([-x[..., 8:], x[..., :8]], -1)
    ref = x * full_cos + rotated * full_sin
    # applied to a strided view, as to the q/k heads inside the fused qkv output
    buf = torch.zeros(5, 7 * 16 + 32)
    view = buf[:, :7 * 16].view(5, 7, 16)
    view.copy_(x)
    apply_rope_(view, cos, sin)
    torch.testing.assert_close(view, ref)
    assert not buf[:, 7 * 16:].any()  # nothing written past the view


def test_folded_norm_weight_equals_norm_then_matmul():
    gen = torch.Generator().manual_seed(3)
    x, g, w = torch.randn(4, 32, generator=gen), torch.rand(32, generator=gen) + 0.5, torch.randn(24, 32, generator=gen)
    ref = F.linear(F.rms_norm(x, (32,), weight=g, eps=1e-6), w)
    torch.testing.assert_close(F.linear(rms_norm(x, 1e-6), fold_norm_weight(w, g)), ref)


def test_rms_norm_of_bfloat16_accumulates_in_float32(monkeypatch):
    """torch's path equals the float32 computation rounded once, bit for bit;
    the native op (its own summation order) within one bfloat16 step."""
    x = (torch.randn(3, 576, generator=torch.Generator().manual_seed(4)) * 30).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (576,), eps=1e-5)
    monkeypatch.setattr(layers, "use_native", False)
    out = rms_norm(x, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.to(torch.bfloat16), atol=0, rtol=0)
    monkeypatch.setattr(layers, "use_native", True)
    if native_layers_op(CPU, torch.bfloat16) is None:
        return
    out = rms_norm(x[:, :500], 1e-5)  # a strided view, a width with a tail
    ref = F.rms_norm(x[:, :500].float(), (500,), eps=1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_native_rope_equals_float32_rotary_rounded_once(head_dim):
    if native_layers_op(CPU, torch.bfloat16) is None:
        pytest.skip(NEEDS_NATIVE)
    gen = torch.Generator().manual_seed(6)
    half, heads = head_dim // 2, 12
    x = torch.randn(5, heads, head_dim, generator=gen)
    angles = torch.randn(5, 1, half, generator=gen)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    x1, x2 = xb.float()[..., :half], xb.float()[..., half:]
    c, s = cos.float(), sin.float()
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    buf = torch.zeros(5, heads * head_dim + 32, dtype=torch.bfloat16)  # strided rows, as in qkv
    view = buf[:, :heads * head_dim].view(5, heads, head_dim)
    view.copy_(xb)
    apply_rope_(view, cos, sin)
    torch.testing.assert_close(view.float(), ref, atol=1e-6, rtol=2 ** -8)
    assert not buf[:, heads * head_dim:].any()


def test_without_the_native_op_bfloat16_takes_onednn(monkeypatch, caplog):
    """No compiler: one warning, and the bfloat16 matmuls take oneDNN's kernel."""
    import logging

    from model_proc import native

    if not onednn_supports(CPU, torch.bfloat16):
        pytest.skip("needs oneDNN with bfloat16 (AVX512_BF16 or AMX)")
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            lin = Linear(64, 64, bias=False).to(torch.bfloat16)
            lin.prepare()
            assert lin.kernel is MatmulKernel.ONEDNN
    lines = [r.getMessage() for r in caplog.records if "native layer ops" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler" in lines[0]


def test_native_lm_head_returns_float32_logits_unrounded(monkeypatch):
    """The LM head's native kernel writes float32 (ParallelLMHead.float_out):
    the logits are the float32 sums, not rounded to bfloat16."""
    from model_proc.layers import ParallelLMHead

    if native_layers_op(CPU, torch.bfloat16) is None:
        pytest.skip(NEEDS_NATIVE)
    gen = torch.Generator().manual_seed(7)
    head = ParallelLMHead(576, 1000).to(torch.bfloat16)
    w = (torch.randn(1000, 576, generator=gen) * 0.05).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(w)
    head.prepare()
    assert head.kernel is MatmulKernel.NATIVE
    x = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        out = head(x)
    ref = x.double() @ w.double().T
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)  # bfloat16 rounding: ~4e-3
