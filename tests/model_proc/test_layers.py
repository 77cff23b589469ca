"""The CPU-tuned building blocks equal their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_proc.layers import Linear, apply_rope_, fold_norm_weight, onednn_supports, rms_norm

CPU = torch.device("cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def make_linear(dtype: torch.dtype, gen: torch.Generator, bias: bool, packed: bool,
                monkeypatch: pytest.MonkeyPatch) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    monkeypatch.setattr(Linear, "use_onednn", packed)
    lin = Linear(48, 80, bias=bias).to(dtype)
    w = (torch.randn(80, 48, generator=gen) * 0.1).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype) if bias else None
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    lin.prepare()
    assert (lin.packed is not None) == (packed and onednn_supports(CPU, dtype))
    return lin, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_and_its_epilogues_equal_plain_torch(dtype, packed, bias, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    lin, w, b = make_linear(dtype, gen, bias, packed, monkeypatch)
    with torch.inference_mode():
        for rows in (1, 7, 33):
            # a strided input, as the MLP's in-place gate * up view is
            x = torch.randn(rows, 96, generator=gen).to(dtype)[:, ::2]
            other = torch.randn(rows, 80, generator=gen).to(dtype)
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            torch.testing.assert_close(lin(x).float(), ref, **TOL[dtype])
            torch.testing.assert_close(lin(x, act="silu").float(), F.silu(ref), **TOL[dtype])
            torch.testing.assert_close(lin(x, add=other).float(), ref + other.float(), **TOL[dtype])
            torch.testing.assert_close(lin(x, mul=other).float(), ref * other.float(), **TOL[dtype])
            assert lin(x).dtype == dtype


def test_packing_drops_the_plain_weight(monkeypatch):
    if not onednn_supports(CPU, torch.float32):
        pytest.skip("no oneDNN here")
    lin, _w, _b = make_linear(torch.float32, torch.Generator().manual_seed(1), False, True, monkeypatch)
    assert lin.weight.numel() == 0 and lin.packed is not None


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


def test_rms_norm_of_bfloat16_accumulates_in_float32():
    x = (torch.randn(3, 576, generator=torch.Generator().manual_seed(4)) * 30).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (576,), eps=1e-5).to(torch.bfloat16)
    out = rms_norm(x, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
