"""What penalties cost per decode step, and that a batch without them pays nothing.

    python -m bench.micro.penalty_cost [--batches 1 16 64] [--context 256] [--steps 10]
                                 [--rounds 3] [--dtype bfloat16] [--model-path PATH]

`ModelRunner.forward` of one decode step of B rows at `context` tokens (KV
already in the pool, as in bench/micro/step_bench.py), greedy, in three cases:
`none` (no row uses penalties: the batch carries no penalty fields), `one`
(row 0 uses every penalty: frequency, presence, repetition, a logit_bias and
min_new_tokens) and `all` (every row does). The penalized rows' state is built
once, as the scheduler's PenaltyInit would at their extend (a 256-token
history). The cases take turns, `--rounds` times, so a change in the
machine's load hits all alike; each figure is the minimum (`--stat median`:
the median) over every timed step. The `penalties ms` column is the penalty work alone (apply + update on
the step's logits), timed the same way. Prints the table only.

Output: stdout only
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.micro.step_bench import decode_batch, fill_pool
from common.messages import ForwardBatch, PenaltyInit
from common.server_args import ServerArgs, default_model_path
from model_proc.runner import ModelRunner

CASES = ("none", "one", "all")


def penalized(batch: ForwardBatch, rows: list[int], history: list[int]) -> ForwardBatch:
    """The batch with `rows` (positions) penalized; their state is built by the first step."""
    inits = [PenaltyInit(row=i, output_ids=history[:64], prompt_ids=history, frequency_penalty=0.5,
                         presence_penalty=0.5, repetition_penalty=1.2, min_new_tokens=10**6, stop_ids=[0, 2],
                         logit_bias={17: 5.0, 42: -100.0}) for i in rows]
    return ForwardBatch(**{**{f: getattr(batch, f) for f in batch.__struct_fields__},
                           "penalty_rows": list(rows), "penalty_inits": inits})


def step_times(runner: ModelRunner, batch: ForwardBatch, steps: int) -> list[float]:
    runner.forward(batch)  # builds the penalized rows' state
    batch.penalty_inits = []
    runner.forward(batch)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.forward(batch)
        out.append(time.perf_counter() - start)
    return out


@torch.inference_mode()
def penalty_times(runner: ModelRunner, batch: ForwardBatch, steps: int) -> list[float]:
    """The penalty work of a step alone, on logits of the step's shape."""
    if not batch.penalty_rows:
        return [0.0]
    logits = torch.randn(len(batch.req_pool_indices), runner.model_config.vocab_size)
    ids = logits.argmax(-1)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.penalties.apply(logits, batch)
        runner.penalties.update(batch, ids)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--stat", default="min", choices=["min", "median"],
                   help="min resists other load on a shared machine; median shows it")
    args = p.parse_args(argv)

    rows = max(args.batches)
    runner = ModelRunner(ServerArgs(model_path=args.model_path or default_model_path(), dtype=args.dtype,
                                    attention_backend="torch", max_running_requests=rows,
                                    context_length=args.context + 1, max_total_tokens=rows * args.context))
    fill_pool(runner, torch.Generator().manual_seed(0))
    history = torch.randint(3, runner.model_config.vocab_size, (256,),
                            generator=torch.Generator().manual_seed(1)).tolist()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"vocab {runner.model_config.vocab_size}, decode context {args.context}, "
          f"{args.stat} of {args.rounds} x {args.steps} steps", flush=True)
    print(f"{'B':>4s} {'none ms':>9s} {'one ms':>9s} {'all ms':>9s} {'one':>7s} {'all':>7s} "
          f"{'penalties ms (one, all)':>24s}", flush=True)
    results = []
    for b in args.batches:
        times: dict[str, list[float]] = {c: [] for c in CASES}
        alone: dict[str, list[float]] = {c: [] for c in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                batch = decode_batch(runner, b, args.context, torch.Generator().manual_seed(b))
                if case != "none":
                    batch = penalized(batch, [0] if case == "one" else list(range(b)), history)
                times[case] += step_times(runner, batch, args.steps)
                alone[case] += penalty_times(runner, batch, args.steps)
        stat = min if args.stat == "min" else statistics.median
        ms = {c: 1e3 * stat(times[c]) for c in CASES}
        pen = {c: 1e3 * stat(alone[c]) for c in CASES}
        results.append({"batch": b, **{f"{c}_ms": ms[c] for c in CASES},
                        **{f"penalties_{c}_ms": pen[c] for c in CASES}})
        print(f"{b:4d} {ms['none']:9.2f} {ms['one']:9.2f} {ms['all']:9.2f} {ms['one'] / ms['none'] - 1:+7.1%} "
              f"{ms['all'] / ms['none'] - 1:+7.1%} {pen['one']:11.3f} {pen['all']:12.3f}", flush=True)
    return results


if __name__ == "__main__":
    main()
