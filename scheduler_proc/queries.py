"""Answers to the tokenizer process's questions (GET /get_server_info,
/metrics, /flush_cache, /timeline): one function per query message, each
answered by a SchedulerReply with the query's id."""

from __future__ import annotations

import time
from typing import Any, Protocol

from common.messages import FlushCacheQuery, SchedulerQuery, SchedulerReply, StateQuery, TimelineQuery
from common.server_args import ServerArgs
from scheduler_proc.cache_manager import CacheManager
from scheduler_proc.decode_manager import DecodeManager
from scheduler_proc.new_token_ratio import NewTokenRatio
from scheduler_proc.output_processor import OutputProcessor
from scheduler_proc.prefill_manager import PrefillManager
from scheduler_proc.request_queue import RequestQueue
from scheduler_proc.speculative.policy import Speculator
from scheduler_proc.timeline import MAX_EVENTS_PER_CALL, Timeline


class SchedulerView(Protocol):
    """What the answers read of scheduler_proc.scheduler.Scheduler (which imports this module)."""

    args: ServerArgs
    cache: CacheManager
    queue: RequestQueue
    prefill: PrefillManager
    decode: DecodeManager
    ratio: NewTokenRatio
    output: OutputProcessor
    timeline: Timeline
    radix_cache_enabled: bool
    invariant_error: str | None
    speculator: Speculator | None

    def is_idle(self) -> bool: ...


def answer(sched: SchedulerView, query: SchedulerQuery) -> SchedulerReply:
    if isinstance(query, StateQuery):
        return SchedulerReply(query_id=query.query_id, ok=True, data=scheduler_state(sched))
    if isinstance(query, TimelineQuery):
        return SchedulerReply(query_id=query.query_id, ok=True, data=timeline_since(sched, query))
    return flush_cache(sched, query)


def timeline_since(sched: SchedulerView, query: TimelineQuery) -> dict[str, Any]:
    limit = min(query.limit, MAX_EVENTS_PER_CALL) if query.limit > 0 else MAX_EVENTS_PER_CALL
    events, more = sched.timeline.since(query.since, query.after_seq, limit)
    return {"now": time.time(), "seq": sched.timeline.seq, "events": events, "more": more,
            "next_seq": events[-1]["seq"] if events else max(query.after_seq, 0)}


def flush_cache(sched: SchedulerView, query: FlushCacheQuery) -> SchedulerReply:
    # Like SGLang, refused while requests are live: their prefixes are locked.
    if not sched.is_idle():
        return SchedulerReply(query_id=query.query_id, ok=False,
                              message="cannot flush the cache while requests are running or waiting")
    sched.cache.flush()
    sched.ratio.reset()
    return SchedulerReply(query_id=query.query_id, ok=True, message="Cache flushed.")


def scheduler_state(sched: SchedulerView) -> dict[str, Any]:
    """The scheduler's live state: queues, KV usage, counters."""
    queue = sched.queue
    return {
        "max_running_requests": sched.args.max_running_requests,
        "batching": sched.args.batching,
        # every live request not waiting was admitted: in the running batch, in
        # the prefill step in flight (not yet merged into it), in a mixed step
        # (the running batch is lent to it), or part way through a chunked
        # prefill. Counting the running batch alone showed 0 running while a
        # prefill held thousands of KV slots, and routers balance on this.
        "num_running_reqs": queue.num_admitted,
        "num_waiting_reqs": len(queue.waiting),
        "num_grammar_queue_reqs": len(sched.queue.grammar_wait),  # waiting for their grammar to compile
        "max_queued_requests": sched.queue.max_queued,
        # of the running: admitted, part of its prompt in the pool, the rest still to prefill
        "num_chunked_prefill_reqs": 0 if sched.prefill.chunked_req is None else 1,
        **sched.cache.stats(),
        "radix_cache": sched.radix_cache_enabled,
        "invariant_error": sched.invariant_error,
        "token_usage": sched.cache.token_usage(),
        "new_token_ratio": sched.ratio.value,
        "total_retractions": sched.decode.total_retractions,
        "enable_mixed_chunk": sched.args.enable_mixed_chunk,
        "num_mixed_steps": sched.decode.num_mixed_steps,
        "batch_utilisation": sched.output.utilisation(),
        "useful_row_steps": sched.output.useful_row_steps,
        "total_row_steps": sched.output.total_row_steps,
        **speculative_state(sched),
    }


def speculative_state(sched: SchedulerView) -> dict[str, Any]:
    """--speculative-algorithm's counts (SGLang's names where it has them)."""
    spec = sched.speculator
    if spec is None:
        return {"speculative_algorithm": ""}
    stats = spec.stats
    decode, verify = spec.decode_cost.line(), spec.verify_cost.line()
    return {
        "speculative_algorithm": sched.args.speculative_algorithm,
        "spec_verify_steps": stats.verify_steps,
        "spec_draft_tokens": stats.drafted,
        "spec_accepted_tokens": stats.accepted,
        "spec_accept_rate": stats.accept_rate,
        # tokens a speculating row kept per verify, over the last 256 rows
        "avg_spec_accept_length": sum(stats.accept_lens) / len(stats.accept_lens) if stats.accept_lens else 0.0,
        # the policy's cost lines: a decode step's ms (fixed, per row), a verify step's (fixed, per token)
        "spec_step_cost_ms": {"decode": [1000 * x for x in decode], "verify": [1000 * x for x in verify]},
    }
