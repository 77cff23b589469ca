"""The native decoder (native_decoder.py NativeDecoder, layers.cpp DecoderStack): a
step's layers in one native call, bit for bit the modules' forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_proc import native
from model_proc.attention import create_attention_backend
from model_proc.layers import native_layers_op
from model_proc.model import LlamaForCausalLM
from model_proc.native_decoder import NativeDecoder
from tests.helpers import RunnerDriver

needs_ops = pytest.mark.skipif(
    native.load() is None or native_layers_op(torch.device("cpu")) is None,
    reason="needs both native ops (a C++ compiler; AMX or AVX512_BF16 for the layer ops)")


class CountingStack:
    """Stands in front of the DecoderStack to count its calls."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.stack.forward(*args)


def greedy_logits(runner: Any, steps: int) -> list[torch.Tensor]:
    """Logits of a ragged prefill, `steps` decode steps, then two mixed steps
    (--enable-mixed-chunk's shape: extend rows first, then rows of one new
    token; the second with one-token rows only), on scattered slots."""
    driver = RunnerDriver(runner, seed=3)
    rows = [driver.new_row() for _ in range(3)]
    prompts = [[5, 9, 14, 3], list(range(20, 57)), [7]]
    logits = [runner.compute_logits(driver.extend(rows, prompts))]
    last = logits[0].argmax(-1).tolist()
    for _ in range(steps):
        step_logits = runner.compute_logits(driver.decode(rows, last))
        logits.append(step_logits)
        last = step_logits.argmax(-1).tolist()
    for new, decode_rows in (([[last[0], 40, 41], [last[1]], [last[2]]], 2), ([[8], [9], [10]], 3)):
        step_logits = runner.compute_logits(driver.extend(rows, new, decode_rows=decode_rows))
        logits.append(step_logits)
        last = step_logits.argmax(-1).tolist()
    return logits


STEPS = 5  # decode steps; the prefill and two mixed steps come with them


def counted(runner: Any) -> CountingStack:
    native_decoder = runner.model.native_decoder
    assert isinstance(native_decoder, NativeDecoder)
    counter = CountingStack(native_decoder.stack)
    runner.model.native_decoder = NativeDecoder(native_decoder.op, counter, native_decoder.backend)
    return counter


@needs_ops
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"], ids=["llama", "qwen2-bias"])
@pytest.mark.parametrize("native_extend", [True, False], ids=["op-extend", "torch-extend"])
def test_native_decoder_equals_the_modules_bit_for_bit(model: str, native_extend: bool, make_runner: Any,
                                                       request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps through the native decoder give the logits of the modules'
    forward exactly (same ops, same order): decode, prefill and mixed steps
    where the backend's extend is the op's; with extend on the torch path,
    decode steps and a mixed step of one-token rows only."""
    path = request.getfixturevalue(model)
    runs = {}
    for use in (False, True):
        monkeypatch.setattr(LlamaForCausalLM, "use_native_decoder", use)
        runner = make_runner(path, dtype="bfloat16", attention_backend="native")
        runner.attn_backend.native_extend = native_extend
        counter = counted(runner)
        runs[use] = greedy_logits(runner, steps=STEPS)
        assert counter.calls == (0 if not use else STEPS + 3 if native_extend else STEPS + 1)
    for step, (ours, ref) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(ours, ref), f"step {step}"


@needs_ops
def test_native_decoder_steps_aside_for_another_backend(tiny_llama_dir: str, make_runner: Any) -> None:
    """A backend swapped in after loading (as bench/attention_bench.py does) is
    the one decode steps use: the native decoder holds the old one's pool."""
    runner = make_runner(tiny_llama_dir, dtype="bfloat16", attention_backend="native")
    counter = counted(runner)
    torch_backend = create_attention_backend("torch", runner.kv_pool, runner.req_to_token, runner.attn_backend.scale)
    runner.attn_backend = torch_backend
    for layer in runner.model.layers:
        layer.self_attn.backend = torch_backend
    greedy_logits(runner, steps=2)
    assert counter.calls == 0


@pytest.mark.parametrize("kwargs", [dict(dtype="float32", attention_backend="native"),
                                    dict(dtype="bfloat16", attention_backend="torch")],
                         ids=["float32", "torch-attention"])
def test_no_native_decoder_where_a_piece_is_not_native(tiny_llama_dir: str, make_runner: Any,
                                                       kwargs: dict[str, Any]) -> None:
    """float32 (no native matmul), the torch attention path (which
    --deterministic requires): the modules run every step."""
    runner = make_runner(tiny_llama_dir, **kwargs)
    assert runner.model.native_decoder is None
    greedy_logits(runner, steps=1)
