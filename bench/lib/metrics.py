"""Per-request timings and the SGLang-style summary computed from them.

Definitions (as SGLang's bench_serving):
- TTFT: send to first output token; ITL: gaps between output tokens (a chunk
  that carries k tokens counts as k gaps of a k-th of its gap each, when the
  backend says how many tokens it carried); TPOT per request:
  (latency - TTFT) / (output tokens - 1); E2E: send to last token.
- Throughputs are over the benchmark's duration; concurrency is the summed
  request latency over that duration (mean number of requests in flight).
- Cache hit rate: the prompt tokens the server found in its prefix cache
  (`meta_info.cached_tokens`) over all prompt tokens, both the server's counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # by the server (meta_info / usage)
    cached_tokens: int = 0  # of the prompt, found in the server's prefix cache (meta_info / usage)
    output_len: int = 0  # by the server
    retokenized_output_len: int = 0  # the returned text encoded again by the client
    client_prompt_len: int = 0  # the prompt by the client's tokenizer
    expected_output_len: int = 0  # what was asked for
    generated_text: str = ""
    start: float = 0.0  # perf_counter() when sent
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def first_token_time(self) -> float:
        return self.start + self.ttft


def percentile_ms(values: Sequence[float], q: float) -> float:
    """q-th percentile (linear interpolation, numpy's default), seconds in, ms out; 0 when empty."""
    return float(np.percentile(values, q)) * 1000 if len(values) else 0.0


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    empty = arr.size == 0
    return {
        f"mean_{name}_ms": 0.0 if empty else float(arr.mean()) * 1000,
        f"median_{name}_ms": percentile_ms(arr, 50),
        f"std_{name}_ms": 0.0 if empty else float(arr.std()) * 1000,
        f"p99_{name}_ms": percentile_ms(arr, 99),
    }


def tpot(r: RequestResult) -> float | None:
    if r.output_len <= 1:
        return None  # one token has no per-output-token time after the first
    return (r.latency - r.ttft) / (r.output_len - 1)


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    duration = max(duration, 1e-9)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_input_tokens_client": sum(r.client_prompt_len for r in ok),
        "total_cached_tokens": total_cached,
        "cache_hit_rate": total_cached / total_in if total_in else 0.0,
        "total_output_tokens": total_out,
        "total_output_tokens_retokenized": sum(r.retokenized_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    out.update(_stats("tpot", [t for r in ok if (t := tpot(r)) is not None]))
    out.update(_stats("e2e_latency", [r.latency for r in ok]))
    return out


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The summary as SGLang prints it: one aligned `name: value` line each."""
    w = 50

    def line(label: str, value: Any) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{v:>10}"

    rows = [f"{' ' + title + ' ':=^{w}}"]
    for label, key in [
        ("Backend:", "backend"), ("Traffic request rate:", "request_rate"),
        ("Max request concurrency:", "max_concurrency"),
        ("Successful requests:", "completed"), ("Failed requests:", "failed"),
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total input tokens (client tokenizer):", "total_input_tokens_client"),
        ("Total cached input tokens (server):", "total_cached_tokens"),
        ("Cache hit rate (cached / input tokens):", "cache_hit_rate"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Total generated tokens (retokenized):", "total_output_tokens_retokenized"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Input token throughput (tok/s):", "input_throughput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Total token throughput (tok/s):", "total_throughput"),
        ("Concurrency:", "concurrency"),
    ]:
        if key in s:
            rows.append(line(label, s[key]))
    if s.get("batch_utilisation") is not None:
        rows.append(line("Batch utilisation (server):", s["batch_utilisation"]))
    for name, title_ in [("e2e_latency", "End-to-End Latency"), ("ttft", "Time to First Token"),
                         ("tpot", "Time per Output Token (excl. 1st token)"), ("itl", "Inter-Token Latency")]:
        rows.append(f"{title_:-^{w}}")
        for stat in ("mean", "median", "p99"):
            rows.append(line(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.split('_')[0].upper()} (ms):",
                             s[f"{stat}_{name}_ms"]))
    rows.append("=" * w)
    return "\n".join(rows)
