"""The native decoder on quantized layers (native_decoder.py's quantized
NativeDecoder, layers.cpp DecoderStack.add_quant_layer): a step's layers on
GGUF blocks in one native call on any CPU, bit for bit the modules' forward
(which takes the same native norm, rotary and epilogue), and the portable ops
themselves against float32 references."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from model_proc import native
from model_proc.layers import native_step_ops
from model_proc.model import LlamaForCausalLM
from model_proc.native_decoder import NativeDecoder
from model_proc.quant import weight as quant_weight
from tests.helpers import RunnerDriver
from tests.model_proc.test_native_decoder import STEPS, CountingStack, greedy_logits

CPU = torch.device("cpu")
needs_ops = pytest.mark.skipif(
    native.load() is None or native_step_ops(CPU) is None or native.load(name="quant") is None,
    reason="needs the native attention, layers and quant modules (a C++ compiler)")


def counted(runner: Any) -> CountingStack:
    decoder = runner.model.native_decoder
    assert isinstance(decoder, NativeDecoder) and decoder.quantized
    counter = CountingStack(decoder.stack)
    runner.model.native_decoder = dataclasses.replace(decoder, stack=counter)
    return counter


@needs_ops
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"], ids=["llama", "qwen2-bias"])
@pytest.mark.parametrize("quantization,q8,dtype", [("int4", False, "bfloat16"), ("int8", False, "float32"),
                                                   ("int4", True, "float32")],
                         ids=["int4-bf16", "int8-f32", "int4-q8-activations-f32"])
def test_quantized_decoder_equals_the_modules_bit_for_bit(model: str, quantization: str, q8: bool, dtype: str,
                                                          make_runner: Any, request: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode and mixed steps through the quantized stack give the logits of
    the modules' forward exactly: prefill, decode steps and two mixed steps
    (all within the gemv's row limit), float gemv or 8-bit activations,
    bfloat16 or float32 activations."""
    monkeypatch.setattr(quant_weight, "use_q8_activations", q8)
    path = request.getfixturevalue(model)
    runs = {}
    for use in (False, True):
        monkeypatch.setattr(LlamaForCausalLM, "use_native_decoder", use)
        runner = make_runner(path, dtype=dtype, attention_backend="native", quantization=quantization)
        runner.attn_backend.native_extend = True  # the mixed steps' extend rows on the op too
        counter = counted(runner)
        runs[use] = greedy_logits(runner, steps=STEPS)
        # the prefill has 42 tokens: above the row limit, the modules run it
        assert counter.calls == (STEPS + 2 if use else 0)
    for step, (ours, ref) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(ours, ref), f"step {step}"


@needs_ops
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(dtype: str, tiny_llama_dir: str, make_runner: Any) -> None:
    """A row decoded alone and beside others gets the same bits, and a verify
    step's tokens (attended as such rows) the bits of decoding them one by
    one: the stack's products are per row, so speculation changes no token."""
    runner = make_runner(tiny_llama_dir, dtype=dtype, attention_backend="native", quantization="int4")
    counter = counted(runner)
    driver = RunnerDriver(runner, seed=5)
    rows = [driver.new_row() for _ in range(4)]
    runner.compute_logits(driver.extend(rows, [[5, 9, 14, 3], [20, 21, 22], [7, 8], [30, 31, 32, 33, 34]]))
    together = runner.compute_logits(driver.decode(rows, [40, 41, 42, 43]))
    for r in rows:  # back one token: each row decodes the same token again, alone
        driver.seq_lens[r] -= 1
    alone = torch.cat([runner.compute_logits(driver.decode([r], [t])) for r, t in zip(rows, [40, 41, 42, 43])])
    assert torch.equal(together, alone)
    row = rows[0]
    one_by_one = torch.cat([runner.compute_logits(driver.decode([row], [t])) for t in (50, 51, 52)])
    driver.seq_lens[row] -= 3
    calls = counter.calls
    verified = runner.compute_logits(driver.verify([row], [50], [[51, 52]]))
    assert counter.calls == calls + 1
    assert torch.equal(verified, one_by_one)


def test_no_quantized_decoder_on_the_torch_attention_path(tiny_llama_dir: str, make_runner: Any) -> None:
    """The torch attention backend (which --deterministic requires): the modules run every step."""
    runner = make_runner(tiny_llama_dir, dtype="bfloat16", attention_backend="torch", quantization="int4")
    assert runner.model.native_decoder is None


# ---- the portable ops ----------------------------------------------------------------------

needs_layers = pytest.mark.skipif(native_step_ops(CPU) is None, reason="needs the native layers module")


ULP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}  # relative: a step, and float32's sum error
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])


@needs_layers
@DTYPES
def test_portable_rms_norm_is_the_float32_norm_rounded_once(dtype: torch.dtype) -> None:
    op = native_step_ops(CPU)
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = F.rms_norm(x.float(), (100,), eps=1e-5)
    out = op.rms_norm(x, 1e-5)
    assert out.dtype == dtype
    # one rounding of a value within float32's error of ref: at most one step apart
    assert ((out.float() - ref).abs() <= ref.abs() * ULP[dtype] + 1e-6).all()


@needs_layers
@DTYPES
def test_portable_rope_is_the_float32_rotation_rounded_once(dtype: torch.dtype) -> None:
    op = native_step_ops(CPU)
    g = torch.Generator().manual_seed(1)
    T, heads, D = 3, 5, 16
    base = torch.randn(T, heads + 2, D, generator=g).to(dtype)  # the rows of a fused qkv output
    angle = torch.rand(T, 1, D // 2, generator=g) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    x = base.clone()
    op.rope_(x.narrow(1, 0, heads), cos, sin)
    x1, x2 = base[:, :heads, :D // 2].float(), base[:, :heads, D // 2:].float()
    c, s = cos.float(), sin.float()
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert ((x[:, :heads].float() - ref).abs() <= ref.abs() * ULP[dtype] + 1e-6).all()
    assert torch.equal(x[:, heads:], base[:, heads:])  # the v heads are not touched


@needs_layers
@DTYPES
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,n_out", [(4, 24), (1, 600), (3, 600)])  # 600: pieces of 256 columns, the last short
def test_finish_adds_bias_gates_and_the_residual_in_float32(gated: bool, dtype: torch.dtype, rows: int,
                                                            n_out: int) -> None:
    op = native_step_ops(CPU)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(rows, 2 * n_out if gated else n_out, generator=g) * 3
    bias = torch.randn(y.shape[1], generator=g)
    add = torch.randn(rows, n_out, generator=g).to(dtype)
    ref = y + bias
    if gated:
        ref = F.silu(ref[:, :n_out]) * ref[:, n_out:]
    ref = ref + add.float()
    out = op.finish(y, n_out, gated, bias, add, dtype)
    assert out.dtype == dtype and out.shape == (rows, n_out)
    assert ((out.float() - ref).abs() <= ref.abs() * ULP[dtype] + 1e-5).all()
    if not gated:  # nothing to add: the float32 product rounded once
        assert torch.equal(op.finish(y, n_out, gated, None, None, dtype), y.to(dtype))
    with pytest.raises(RuntimeError, match="columns"):
        op.finish(y, n_out + 1, gated, None, None, dtype)
