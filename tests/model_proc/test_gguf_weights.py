"""A GGUF file's matmul weights served as its own blocks: every quantized
tensor of the default model, read as blocks (q/k rows put back in
Hugging Face's order), dequantizes to exactly what transformers' GGUF
loader makes of it; a weight's row and column slices and stacks are the
same slices of its float form; a model served on blocks gives the logits
of the same model dequantized at load (`--quantization none`)."""

from __future__ import annotations

import pytest
import torch

from bench.lib.gguf_models import ggml_qk_order, write_llama_gguf
from common.server_args import ServerArgs, default_model_path
from model_proc.layers import Linear, MatmulKernel
from model_proc.quant.ggml_types import GGMLType
from model_proc.quant.gguf_weights import GGUFWeights, llama_qk_order
from model_proc.quant import int8_act, weight
from model_proc.quant.weight import QuantWeight
from model_proc.runner import ModelRunner
from model_proc.weights import CheckpointReader, load_state_dict
from tests.helpers import RunnerDriver, make_tiny_llama

PROMPT, ANSWER = [5, 9, 200, 3, 77, 41, 8], [4, 99, 250, 7]
# KL(float32 || 8-bit activations) per position on the default model and these
# random-token prompts: measured 1e-4 to 0.014 nats (a broken kernel gives > 1)
Q8_MAX_KL = 0.05


def test_every_quantized_tensor_of_the_default_model_dequantizes_to_transformers_float(default_model_dir):
    with CheckpointReader(default_model_dir) as ckpt:
        weights = GGUFWeights(default_model_path(), ckpt.names(), num_heads=9, num_kv_heads=3)
        # SmolLM2's file: every matmul in Q4_1, the (tied) embedding in Q8_0
        assert len(weights) == 30 * 7 + 1 and not weights.float_types
        assert weights.get("model.embed_tokens.weight").segments[0].qtype is GGMLType.Q8_0
        # the first and last layers' and the embedding (reading all 540 MB of floats is slow)
        names = [n for n in ckpt.names() if n.startswith(("model.layers.0.", "model.layers.29.", "model.embed"))]
        assert sum(weights.get(n) is not None for n in names) == 2 * 7 + 1
        for name in names:
            w = weights.get(name)
            if w is not None:
                assert torch.equal(w.dequantize(), ckpt.read(name)), name


def test_the_qk_row_orders_are_inverse_permutations():
    for rows, heads in [(576, 9), (192, 3), (64, 4)]:
        assert torch.equal(ggml_qk_order(rows, heads)[llama_qk_order(rows, heads)], torch.arange(rows))


def _blocks_of(w: torch.Tensor, qtype: str) -> QuantWeight:
    import gguf

    data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return QuantWeight.of(GGMLType[qtype], torch.from_numpy(data), w.shape[1])


def test_slices_and_stacks_of_blocks_are_the_slices_and_stacks_of_their_floats(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a = _blocks_of(torch.randn(48, 128, generator=g), "Q4_0")
    b = _blocks_of(torch.randn(16, 128, generator=g), "Q8_0")
    fa, fb = a.dequantize(), b.dequantize()
    both = QuantWeight.cat([a, b, a.rows(0, 8)])
    assert [s.qtype for s in both.segments] == [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_0]
    assert torch.equal(both.dequantize(), torch.cat([fa, fb, fa[:8]]))
    assert torch.equal(both.rows(40, 70).dequantize(), torch.cat([fa, fb, fa[:8]])[40:70])
    assert torch.equal(both.columns(32, 96).dequantize(), torch.cat([fa, fb, fa[:8]])[:, 32:96])
    assert torch.equal(a.take_rows(torch.tensor([3, 0, 47])).dequantize(), fa[[3, 0, 47]])
    x = torch.randn(3, 128, generator=g)
    scale = torch.rand(128, generator=g) + 0.5
    w = torch.cat([fa, fb, fa[:8]]).double()
    ref = (x.double() * scale.double()) @ w.T
    monkeypatch.setattr(weight, "use_q8_activations", False)  # the float32 product
    got = both.scaled_input(scale).matmul(x)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    # 8-bit activations: the product with the scaled x as int8_act rounds it, across the segments
    monkeypatch.setattr(weight, "use_q8_activations", True)
    rounded = int8_act.quantize_rows((x * scale).float()).dequantize().double()
    got = both.scaled_input(scale).matmul(x)
    assert torch.allclose(got.double(), rounded @ w.T, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    with pytest.raises(ValueError, match="splits only on its 32-weight blocks"):
        a.columns(16, 64)


def test_a_prefill_sized_product_takes_the_rounded_x_a_decode_sized_one_takes(monkeypatch):
    """Above Q8_MAX_ROWS (the dequantized tiles) x is rounded to 8-bit blocks
    as the integer kernel rounds it: each row's product equals that row alone
    (the integer kernel) up to float32 summation order: a prefill's products
    and a decode step's take the same arithmetic; switched off, float x."""
    g = torch.Generator().manual_seed(3)
    w = _blocks_of(torch.randn(64, 256, generator=g), "Q4_1")
    x = torch.randn(weight.Q8_MAX_ROWS + 8, 256, generator=g)
    monkeypatch.setattr(weight, "use_q8_activations", True)
    many = w.matmul(x)
    alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(x.shape[0])])
    rounded = int8_act.quantize_rows(x).dequantize().double() @ w.dequantize().double().T
    tol = 1e-5 * rounded.abs().max().item()
    assert (many.double() - rounded).abs().max().item() <= tol
    assert (alone.double() - rounded).abs().max().item() <= tol
    monkeypatch.setattr(weight, "use_q8_activations", False)
    exact = x.double() @ w.dequantize().double().T
    assert (w.matmul(x).double() - exact).abs().max().item() <= tol
    assert (many.double() - exact).abs().max().item() > 100 * tol  # not a test of nothing


def test_the_default_model_on_its_blocks_gives_the_logits_of_its_dequantized_weights(monkeypatch):
    """The default model (Q4_1 matmuls, Q8_0 embedding and tied head) served
    on its blocks and dequantized at load (`--quantization none`): the same
    logits with float32 activations (the default); with 8-bit ones, the same
    next tokens and a small KL."""
    def runner(quantization: str) -> ModelRunner:
        return ModelRunner(ServerArgs(model_path=default_model_path(), dtype="float32", max_total_tokens=256,
                                      max_running_requests=2, quantization=quantization))

    floats = runner("none")
    assert MatmulKernel.QUANT not in {m.kernel for m in floats.model.modules() if isinstance(m, Linear)}
    ref = RunnerDriver(floats).teacher_forced_logits(PROMPT, ANSWER)
    del floats
    blocks = runner("")
    kernels = {m.kernel for m in blocks.model.modules() if isinstance(m, Linear)}
    assert kernels == {MatmulKernel.QUANT} and blocks.model.embed_tokens.quantized is not None
    monkeypatch.setattr(weight, "use_q8_activations", True)
    q8 = RunnerDriver(blocks).teacher_forced_logits(PROMPT, ANSWER)
    monkeypatch.setattr(weight, "use_q8_activations", False)
    f32 = RunnerDriver(blocks).teacher_forced_logits(PROMPT, ANSWER)
    # the same weights, float32 sums in another order (the norm applied to x, not folded into W)
    assert (f32 - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    kl = torch.nn.functional.kl_div(q8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    print(f"8-bit activations: KL per position {kl.tolist()}")
    assert torch.equal(q8.argmax(-1), ref.argmax(-1))
    assert kl.max().item() < Q8_MAX_KL


def test_a_written_gguf_reads_back_as_the_quantized_checkpoint(tmp_path):
    """bench/lib/gguf_models.py's file: every matmul weight reads back (q/k
    rows in Hugging Face's order again) as gguf-py's quantization of the
    checkpoint's tensor."""
    import gguf

    model = make_tiny_llama(str(tmp_path / "hf"), seed=3)
    qtype = "Q4_0"  # the other types gguf-py writes take the same path
    path = write_llama_gguf(model, str(tmp_path / "tiny.gguf"), qtype, with_tokenizer=False)
    state = load_state_dict(model)
    weights = GGUFWeights(path, list(state), num_heads=4, num_kv_heads=2)
    matmuls = [n for n, t in state.items() if t.dim() == 2]
    assert len(weights) == len(matmuls) == 2 * 7 + 2  # untied: embedding and head
    kind = gguf.GGMLQuantizationType[qtype]
    for name in matmuls:
        want = gguf.quants.dequantize(gguf.quants.quantize(state[name].float().numpy(), kind), kind)
        assert torch.equal(weights.get(name).dequantize(), torch.from_numpy(want)), name


def test_quantization_gguf_needs_a_gguf_file(tiny_llama_dir):
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf model"):
        ServerArgs(model_path=tiny_llama_dir, quantization="gguf")
    with pytest.raises(ValueError, match="--quantization must be one of gguf, none"):
        ServerArgs(model_path=tiny_llama_dir, quantization="awq")
