"""What the window pool saves on the real Gemma 3 270M (issue 30 item 2), a
check to run by hand (`./scripts/install.sh --gemma` first): float32,
through the real scheduler and model runner (the engine of
tests/scheduler/test_engine_matches_transformers.py), a 3000-token prompt
prefilled in 512-token chunks and 16 greedy tokens, once with the window
pool (--swa-full-tokens-ratio 0.25) and once with one pool
(--disable-hybrid-swa-memory), both in a 4096-token pool. Prints the KV
buffers' bytes, the most slots held in each pool, and whether the tokens
are equal.

    python scripts/window_pool_check.py
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.server_args import ServerArgs, gemma3_270m_path  # noqa: E402 (the repository on the path first)
from model_proc.weights import resolve_model_path  # noqa: E402
from tests.scheduler.test_engine_matches_transformers import Engine  # noqa: E402

folder = resolve_model_path(gemma3_270m_path(), ServerArgs().cache_dir)
rng = random.Random(0)
prompt = [rng.randrange(300, 200000) for _ in range(3000)]
outs = {}
for mode, extra in (("window pool", {"swa_full_tokens_ratio": 0.25}), ("one pool", {"disable_hybrid_swa_memory": True})):
    e = Engine(folder, max_running_requests=2, max_total_tokens=4096, chunked_prefill_size=512, **extra)
    cache = e.sched.cache
    peak = {"full": 0, "window": 0}
    step = e.sched.step
    def measured():
        b = step()
        peak["full"] = max(peak["full"], cache.size - cache.allocator.available())
        if cache.window_pool is not None:
            peak["window"] = max(peak["window"], cache.window_pool.size - cache.window_pool.available())
        return b
    e.sched.step = measured
    t = time.time()
    e.run({0: [("a", prompt, 16)]})
    outs[mode] = e.reqs["a"].output_ids
    print(mode, "kv_cache_bytes", e.runner.model_info.kv_cache_bytes, "window pool tokens",
          e.runner.model_info.window_pool_tokens, "peak full", peak["full"], "peak window", peak["window"],
          f"{time.time() - t:.0f} s", flush=True)
print("equal tokens:", outs["window pool"] == outs["one pool"], outs["window pool"])
