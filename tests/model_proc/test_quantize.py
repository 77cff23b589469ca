"""A Hugging Face folder's weights rounded into GGUF blocks at load
(`--quantization int8 / int4 / w8a8_int8`, model_proc/quant/quantize.py):
the blocks are gguf-py's (llama.cpp's reference quantizer) bit for bit; only
the layers' matmul weights are rounded; a model on them stays near its
float32 logits, closer with 8 bits than with 4."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from common.server_args import ServerArgs
from model_proc.quant import weight as quant_weight
from model_proc.quant.ggml_types import GGMLType
from model_proc.quant.quantize import AT_LOAD_TYPES, QUANTIZERS, QuantizedAtLoad
from model_proc.runner import ModelRunner
from model_proc.weights import CheckpointReader
from tests.helpers import RunnerDriver, make_tiny_llama


def awkward_weights(seed: int, scale: float) -> torch.Tensor:
    """[48, 256] normal weights with blocks that test the rules' edges: all
    zero, constant, a negative extreme, exact halves (rounding ties)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 256, generator=g) * scale
    w[0, :32] = 0
    w[1, 32:64] = w[1, 32]
    w[2, 5] = -w[2, :32].abs().max() * 2
    w[3, 64:96] = torch.tensor([0.5, -0.5] * 16) * scale
    w[4, 96:128] = torch.arange(32) * 0.25 * scale  # many values on the quantization grid
    return w


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_blocks_equal_gguf_py_quantize_bit_for_bit(qtype: GGMLType, scale: float) -> None:
    w = awkward_weights(int(qtype) * 7 + int(scale * 10), scale)
    ours = QUANTIZERS[qtype](w)
    assert ours.dtype == torch.uint8
    reference = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert np.array_equal(ours.numpy(), reference)


# (step between levels, largest error in steps) per block: Q4_0's 16 levels
# run from -8 to 7 steps of amax / 8, so the end opposite the extreme is
# clamped a whole step short
STEPS = {GGMLType.Q8_0: (lambda b: b.abs().amax(1) / 127, 0.5),
         GGMLType.Q4_0: (lambda b: b.abs().amax(1) / 8, 1.0),
         GGMLType.Q4_1: (lambda b: (b.amax(1) - b.amin(1)) / 15, 0.5)}


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: t.name)
def test_the_blocks_dequantize_back_within_their_rounding(qtype: GGMLType) -> None:
    w = awkward_weights(3, 1.0)
    back = torch.from_numpy(gguf.quants.dequantize(QUANTIZERS[qtype](w).numpy(),
                                                   gguf.GGMLQuantizationType(int(qtype)))).float()
    blocks, err = w.reshape(-1, 32), (back - w).abs().reshape(-1, 32).amax(1)
    step_of, steps = STEPS[qtype]
    step, amax = step_of(blocks), blocks.abs().amax(1)
    # plus the float16 rounding of the scale (over up to 16 steps) and of Q4_1's minimum
    assert (err <= step * (steps + 16 * 2**-11) + amax * 2**-10 + 1e-12).all()
    assert (err[1:] > 0).any()  # not a test of nothing


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # intermediate 48: down_proj's rows are not whole 32-weight blocks and stay in float
    return make_tiny_llama(str(tmp_path_factory.mktemp("quant_tiny")), intermediate_size=48)


def test_only_the_layer_matmuls_are_rounded_and_a_width_off_the_blocks_stays_float(model_dir: str) -> None:
    with CheckpointReader(model_dir) as ckpt:
        q = QuantizedAtLoad(ckpt, GGMLType.Q8_0)
        names = ckpt.names()
    rounded = {n for n in names if q.get(n) is not None}
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj"]
    assert rounded == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in layer}
    assert set(q.float_types) == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    assert "48 columns" in q.float_types["model.layers.0.mlp.down_proj.weight"]
    # Q8_0: 34 bytes per 32 weights
    assert q.nbytes == sum(q.get(n).shape[0] * q.get(n).shape[1] // 32 * 34 for n in rounded)


def teacher_forced(model_dir: str, quantization: str) -> torch.Tensor:
    saved = quant_weight.use_q8_activations
    quant_weight.use_q8_activations = ServerArgs(model_path=model_dir, quantization=quantization).int8_activations
    try:
        runner = ModelRunner(ServerArgs(model_path=model_dir, dtype="float32", max_total_tokens=256,
                                        max_running_requests=2, quantization=quantization))
        return RunnerDriver(runner, seed=1).teacher_forced_logits([5, 9, 200, 3, 77, 41, 8, 300, 2, 11],
                                                                  [4, 99, 250, 7, 17, 18, 19, 20])
    finally:
        quant_weight.use_q8_activations = saved


def mean_kl(ref: torch.Tensor, x: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(x.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_a_model_on_rounded_weights_stays_near_its_float_logits(model_dir: str) -> None:
    """The tiny model's weights are wide (std 0.3, two layers), so rounding
    moves its logits far more than a trained model's: the bounds are this
    seeded model's, measured (int8 4.9e-3, w8a8 9.5e-3, int4 0.72 nats),
    with room; int4 must be the furthest."""
    ref = teacher_forced(model_dir, "")
    kl = {q: mean_kl(ref, teacher_forced(model_dir, q)) for q in AT_LOAD_TYPES}
    print("mean KL to float32:", kl)
    assert 0 < kl["int8"] < 0.03 and 0 < kl["w8a8_int8"] < 0.03
    assert kl["int4"] > 5 * max(kl["int8"], kl["w8a8_int8"])
    assert kl["int4"] < 2.0


def test_quantizing_a_gguf_again_is_refused_and_w8a8_rounds_activations() -> None:
    with pytest.raises(ValueError, match="rounds a Hugging Face folder's float weights"):
        ServerArgs(model_path="model.Q4_1.gguf", quantization="int8")
    assert ServerArgs(model_path="m", quantization="w8a8_int8").int8_activations
    assert not ServerArgs(model_path="m", quantization="int8").int8_activations
    assert ServerArgs(model_path="m", quantization="int4", quantize_activations=True).int8_activations
