"""Prometheus text-format metrics (GET /metrics with --enable-metrics).

Latencies are observed here, where requests end; the gauges of the scheduler
(running, queued, KV usage, retractions) are read from it when scraped. The
format is simple enough to write by hand, so no client library is needed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

PREFIX = "batchserve_"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.n += times

    def render(self) -> list[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(list(self.buckets) + [float("inf")], self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             E2E_BUCKETS)

    def observe_finished(self, *, prompt_tokens: int, completion_tokens: int, finish_type: str,
                         arrival: float, first_token: float, finished: float,
                         cached_tokens: int = 0) -> None:
        """Times are wall-clock seconds. Inter-token latency is the request's
        mean gap, counted once per gap: the scheduler batches a non-streaming
        request's tokens into one message, so single gaps are not seen here."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generation_tokens += completion_tokens
        self.requests_finished[finish_type] = self.requests_finished.get(finish_type, 0) + 1
        self.e2e.observe(max(0.0, finished - arrival))
        if first_token > 0:
            self.ttft.observe(max(0.0, first_token - arrival))
            if completion_tokens > 1:
                self.itl.observe(max(0.0, finished - first_token) / (completion_tokens - 1),
                                 times=completion_tokens - 1)

    def render(self, scheduler_state: dict[str, Any] | None) -> str:
        lines: list[str] = []

        def scalar(name: str, kind: str, help_: str, value: float, labels: str = "") -> None:
            full = PREFIX + name
            if not any(line.startswith(f"# TYPE {full} ") for line in lines):
                lines.extend([f"# HELP {full} {help_}", f"# TYPE {full} {kind}"])
            lines.append(f"{full}{labels} {value}")

        if scheduler_state is not None:
            s = scheduler_state
            scalar("num_running_reqs", "gauge", "Requests in the running batch.", s["num_running_reqs"])
            scalar("num_queue_reqs", "gauge", "Requests waiting.", s["num_waiting_reqs"])
            scalar("token_usage", "gauge", "Share of KV slots in use.", s["token_usage"])
            scalar("num_retractions_total", "counter", "Requests retracted.", s["total_retractions"])
            scalar("new_token_ratio", "gauge", "Admission estimate of output still to come.",
                    s["new_token_ratio"])
            scalar("batch_utilisation", "gauge", "Useful row-steps over computed row-steps.",
                    s["batch_utilisation"])
            scalar("cache_hit_rate", "gauge", "Prompt tokens taken from the prefix cache over "
                   "prompt tokens offered to it at admission.", s["cache_hit_rate"])
            scalar("evictable_kv_slots", "gauge", "KV slots cached and evictable.",
                   s["evictable_kv_slots"])
            if s.get("speculative_algorithm"):
                scalar("spec_verify_steps_total", "counter", "Steps that verified drafts.", s["spec_verify_steps"])
                scalar("spec_draft_tokens_total", "counter", "Draft tokens verified.", s["spec_draft_tokens"])
                scalar("spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
                       s["spec_accepted_tokens"])
                scalar("spec_accept_rate", "gauge", "Accepted over verified draft tokens.", s["spec_accept_rate"])
        scalar("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               self.prompt_tokens)
        scalar("cached_tokens_total", "counter", "Prompt tokens of finished requests served "
               "by the prefix cache.", self.cached_tokens)
        scalar("generation_tokens_total", "counter", "Output tokens of finished requests.",
               self.generation_tokens)
        for kind, count in sorted(self.requests_finished.items()):
            scalar("requests_finished_total", "counter", "Finished requests by finish reason.",
                   count, f'{{reason="{kind}"}}')
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        return "\n".join(lines) + "\n"
