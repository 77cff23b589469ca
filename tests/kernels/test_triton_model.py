"""The tiny model end to end with --attention-backend triton (interpreter):
the same greedy tokens and logits as the torch backend."""

from __future__ import annotations

from typing import Any

import torch

from common.messages import ForwardBatch
from tests.helpers import RunnerDriver

PROMPTS = [[1, 45, 300, 12, 7, 99, 101], [9, 8], list(range(20, 45))]


def run(runner: Any, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Ragged prefill, decode, then an extend with a prefix in the pool (a
    follow-up turn), then decode again; the logits of every step."""
    driver = RunnerDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    logits = []

    def step(batch: ForwardBatch) -> list[int]:
        logits.append(runner.compute_logits(batch))
        return logits[-1].argmax(-1).tolist()

    out = [[t] for t in step(driver.extend(rows, PROMPTS))]
    for _ in range(steps):
        for o, t in zip(out, step(driver.decode(rows, [o[-1] for o in out]))):
            o.append(t)
    follow_up = [[o[-1], 17, 33] for o in out]
    for o, t in zip(out, step(driver.extend(rows, follow_up))):
        o.append(t)
    for _ in range(steps):
        for o, t in zip(out, step(driver.decode(rows, [o[-1] for o in out]))):
            o.append(t)
    return out, logits


def test_triton_backend_greedy_equals_torch_backend(tiny_llama_dir: str, make_runner: Any) -> None:
    tokens, logits = {}, {}
    for name in ("torch", "triton"):
        runner = make_runner(tiny_llama_dir, attention_backend=name)
        assert type(runner.attn_backend).__name__.lower().startswith(name)
        tokens[name], logits[name] = run(runner, steps=4)
    assert tokens["triton"] == tokens["torch"]
    for ours, ref in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
