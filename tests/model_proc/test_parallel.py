"""Tensor parallelism in process: N gloo ranks (torch.multiprocessing spawn),
each a ModelRunner over its shard of a tiny random model, give the logits,
greedy tokens and a speculative verify's kept tokens of the one-process
runner; the head split is checked on its own."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from common.server_args import ServerArgs
from model_proc.parallel import HeadShard, TensorParallel, init_tensor_parallel, shard_heads, vocab_range
from model_proc.runner import ModelRunner
from tests.helpers import RunnerDriver, make_tiny_llama

PROMPTS = [[5, 9, 200, 3, 77, 41, 8], [300, 2, 11], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
NEW_TOKENS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_args(model: str, quantization: str = "") -> ServerArgs:
    return ServerArgs(model_path=model, dtype="float32", max_total_tokens=512, max_running_requests=4,
                      quantization=quantization)


def logits_and_greedy(runner: ModelRunner) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Teacher-forced logits of one prompt (an extend, then decodes), a
    ragged greedy batch of every prompt, and a speculative verify step (two
    rows: drafts right then wrong, and all right) with its kept tokens."""
    logits = RunnerDriver(runner, seed=1).teacher_forced_logits(PROMPTS[0], [4, 99, 250, 7])
    greedy = RunnerDriver(runner, seed=2).greedy(PROMPTS, NEW_TOKENS)
    driver = RunnerDriver(runner, seed=3)
    rows = [driver.new_row(), driver.new_row()]
    first = driver.step(driver.extend(rows, PROMPTS[:2]))
    drafts = [greedy[0][1:3] + [(greedy[0][3] + 1) % 512], greedy[1][1:5]]
    return logits, greedy, driver.step_verify(driver.verify(rows, first, drafts))


def weight_numel(runner: ModelRunner) -> int:
    """Elements of the weights this runner holds (packed copies included)."""
    packed = [m.packed for m in runner.model.modules() if getattr(m, "packed", None) is not None]
    return sum(p.numel() for p in runner.model.parameters()) + sum(p.numel() for p in packed)


def _rank_main(rank: int, size: int, addr: str, models: dict[str, tuple[str, str]], out_dir: str) -> None:
    """One rank of `size`: every model of that size in turn, over one group
    (a spawn per model cost ~2.5 s of process start and imports)."""
    torch.set_num_threads(1)  # N ranks on 2 cores
    tp = init_tensor_parallel(rank, size, addr, torch.device("cpu"))
    try:
        for case, (model, quantization) in models.items():
            runner = ModelRunner(runner_args(model, quantization), tp)
            logits, greedy, verified = logits_and_greedy(runner)
            torch.save({"logits": logits, "greedy": greedy, "verified": verified, "params": weight_numel(runner),
                        "kv_shape": tuple(runner.kv_pool.k_buffer[0].shape)},
                       os.path.join(out_dir, f"{case}.{rank}.pt"))
            del runner
    finally:
        tp.close()


def run_ranks(size: int, models: dict[str, tuple[str, str]], out_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Each case's per-rank results, from one spawn of `size` ranks; models:
    case -> (model folder, --quantization)."""
    mp.start_processes(_rank_main, args=(size, f"127.0.0.1:{free_port()}", models, out_dir), nprocs=size,
                       start_method="spawn")
    return {case: [torch.load(os.path.join(out_dir, f"{case}.{r}.pt")) for r in range(size)] for case in models}


# (tp size, tiny-model overrides): heads split evenly; one KV head copied to
# both ranks; 3 ranks over a vocabulary of 512 (the last slice padded)
CASES = {
    "tp2": (2, {}),
    "tp2_kv_heads_replicated": (2, {"num_key_value_heads": 1}),
    "tp3_vocab_padded": (3, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                             "intermediate_size": 192}),
    # Phi-3: each rank's rows out of the checkpoint's fused qkv_proj and gate_up_proj
    "tp2_phi3_fused_checkpoint": (2, {"model_type": "phi3"}),
    # Qwen3: the q/k norms on a rank's share of the heads, its one KV head a copy
    "tp2_qwen3_kv_heads_replicated": (2, {"model_type": "qwen3", "num_key_value_heads": 1}),
    # Gemma 3: sliding layers (window 4, so the prompts cross it) with their K/V in the window pool
    "tp2_gemma3_sliding_window": (2, {"model_type": "gemma3_text", "sliding_window": 4, "query_pre_attn_scalar": 24,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    # Gemma 2: soft-capped scores and logits on each rank's heads and vocabulary slice
    "tp2_gemma2_softcaps": (2, {"model_type": "gemma2", "sliding_window": 4, "query_pre_attn_scalar": 24,
                                "attn_implementation": "eager"}),
    # weights rounded into blocks at load: each rank's rows, and o/down_proj's columns on block
    # boundaries, of the blocks one process rounds (the same blocks, so the same logits)
    "tp2_int8": (2, {}),
    "tp2_int4": (2, {}),
}
QUANTIZATION = {"tp2_int8": "int8", "tp2_int4": "int4"}  # --quantization per case ("" where absent)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every case's per-rank results: one spawn per tp size."""
    root = tmp_path_factory.mktemp("tp_cases")
    models = {case: make_tiny_llama(str(root / case), seed=3, **overrides)
              for case, (_, overrides) in CASES.items()}
    results: dict[str, list[dict[str, Any]]] = {}
    for size in sorted({size for size, _ in CASES.values()}):
        out = root / f"out{size}"
        out.mkdir()
        results.update(run_ranks(size, {c: (m, QUANTIZATION.get(c, "")) for c, m in models.items()
                                        if CASES[c][0] == size}, str(out)))
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_logits_and_greedy_tokens_equal_one_process(case, tp_results, tmp_path):
    size, overrides = CASES[case]
    model = make_tiny_llama(str(tmp_path / "model"), seed=3, **overrides)  # the same seed: the same weights
    single = ModelRunner(runner_args(model, QUANTIZATION.get(case, "")))
    ref_logits, ref_greedy, ref_verified = logits_and_greedy(single)
    assert [len(k) for k in ref_verified] == [3, 5]  # two drafts kept and the sample after; all four and one
    ref_params = weight_numel(single)
    ranks = tp_results[case]
    assert len(ranks) == size
    scale = ref_logits.abs().max().item()
    for r, res in enumerate(ranks):
        # float32 with the sums in another order: rounding only
        diff = (res["logits"] - ref_logits).abs().max().item()
        assert diff <= 1e-5 * scale, f"rank {r}: logits differ by {diff} (scale {scale})"
        assert res["greedy"] == ref_greedy, f"rank {r}"
        assert res["verified"] == ref_verified, f"rank {r}"
        # each rank holds its shard only: about 1/size of the weights (norms folded, vocab padded)
        assert res["params"] <= ref_params / size * 1.05, (r, res["params"], ref_params)
    heads = shard_heads(overrides.get("num_attention_heads", 4), overrides.get("num_key_value_heads", 2), 0, size)
    assert ranks[0]["kv_shape"][1] == heads.num_kv_heads


def test_head_split_replicates_kv_heads_when_ranks_outnumber_them():
    # the default model: 9 query heads, 3 KV heads
    assert [shard_heads(9, 3, r, 3) for r in range(3)] == [HeadShard(3, 1, 3 * r, r) for r in range(3)]
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [shard_heads(8, 2, r, 4).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert vocab_range(512, 2, 3) == (342, 512, 171)


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (9, 3, 2, "does not divide the model's 9 attention heads"),
    (8, 6, 4, "does not divide the model's 6 KV heads"),
    (12, 4, 6, "is not a multiple of the model's 4 KV heads"),
])
def test_a_tp_size_that_does_not_fit_the_heads_is_a_clear_error(heads, kv_heads, size, message):
    with pytest.raises(ValueError, match=message):
        shard_heads(heads, kv_heads, 0, size)


def test_the_runner_refuses_a_tp_size_that_does_not_divide_the_heads(tiny_llama_dir):
    # a rank of 3 built without a group: the check comes before any collective
    with pytest.raises(ValueError, match="--tp-size 3 does not divide the model's 4 attention heads"):
        ModelRunner(runner_args(tiny_llama_dir), TensorParallel(rank=0, size=3))
