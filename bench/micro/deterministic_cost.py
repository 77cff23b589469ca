"""What `--deterministic` (model_proc/row_blocks.py) costs per step.

    python -m bench.micro.deterministic_cost [--batches 1 16 64] [--context 256] [--steps 5]
                                       [--rounds 2] [--prefill 256] [--dtype float32]

Decode: `ModelRunner.forward` of one step of B rows, each at `context` tokens
whose KV is already in the pool (random values on scattered slots, as in
bench/micro/step_bench.py; no prefill is run), greedy. Prefill: one prompt of
`--prefill` tokens into an empty row (0: skipped). The default model, the
torch attention backend, both runners built in this process; the two modes
take turns, `--rounds` times per case, so that a change in the machine's
load hits both alike. Each figure is the median over every timed step
(`--steps` per round, after 2 warm-ups). Prints the table only.

Output: stdout only
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.micro.step_bench import decode_batch, fill_pool
from common.messages import ForwardBatch, ForwardMode
from common.server_args import ServerArgs, default_model_path
from model_proc.runner import ModelRunner


def make_runner(dtype: str, deterministic: bool, rows: int, context: int, pool: int) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=default_model_path(), dtype=dtype, attention_backend="torch",
                                  max_running_requests=rows, context_length=context,
                                  max_total_tokens=pool, deterministic=deterministic))


def prefill_batch(runner: ModelRunner, tokens: int, gen: torch.Generator) -> ForwardBatch:
    row = runner.server_args.max_running_requests  # a row no decode case uses
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=[row], seq_lens=[tokens], prefix_lens=[0],
        input_ids=torch.randint(3, runner.model_config.vocab_size, (tokens,), generator=gen).tolist(),
        out_cache_loc=(torch.randperm(runner.kv_pool.size, generator=gen)[:tokens] + 1).tolist(),
        temperatures=[0.0], top_ps=[1.0], top_ks=[-1], min_ps=[0.0], seeds=[-1], sample_steps=[0])


def step_times(runner: ModelRunner, batch: ForwardBatch, steps: int) -> list[float]:
    for _ in range(2):
        runner.forward(batch)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.forward(batch)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill case (0: none)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)

    rows = max(args.batches) + 1
    context = max(args.context, args.prefill) + 1
    pool = max(args.batches) * args.context + args.prefill
    gen = torch.Generator().manual_seed(0)
    runners = {}
    for det in (False, True):
        runners[det] = make_runner(args.dtype, det, rows, context, pool)
        fill_pool(runners[det], gen)
    cases: list[tuple[str, int]] = [("decode", b) for b in args.batches]
    if args.prefill:
        cases.append(("prefill", args.prefill))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"decode context {args.context}, median of {args.rounds} x {args.steps} steps", flush=True)
    print(f"{'case':>16s} {'default ms':>11s} {'deterministic ms':>17s} {'cost':>7s}", flush=True)
    for kind, n in cases:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for det, runner in runners.items():
                # the same table rows, slots and inputs for both modes
                batch = (decode_batch(runner, n, args.context, torch.Generator().manual_seed(n))
                         if kind == "decode" else prefill_batch(runner, n, torch.Generator().manual_seed(n)))
                times[det] += step_times(runner, batch, args.steps)
        off, on = (1e3 * statistics.median(times[d]) for d in (False, True))
        label = f"{kind} {'B' if kind == 'decode' else 'T'}={n}"
        print(f"{label:>16s} {off:11.1f} {on:17.1f} {on / off - 1:+7.0%}", flush=True)


if __name__ == "__main__":
    main()
