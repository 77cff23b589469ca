"""A request as the scheduler tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from common.messages import (AbortKind, FinishAbort, FinishLength, FinishMatchedToken, FinishReason, PenaltyInit,
                             SamplingParams, TokenizedGenerateReq)
from scheduler_proc.thinking_budget import ThinkingBudget


class ReqState(Enum):
    """Where a request is in its lifecycle (docs/architecture.md draws it)."""

    WAITING_FOR_GRAMMAR = "waiting for its grammar"  # its grammar is compiling
    WAITING = "waiting"  # in the waiting queue, never admitted
    RUNNING = "running"  # holds a table row: prefilling (maybe in chunks) or decoding
    RETRACTED = "retracted"  # back in the waiting queue with its tokens, its KV freed
    FINISHED = "finished"  # has its finish reason; its KV is freed (or kept as padding)


@dataclass(slots=True, eq=False)  # identity, not field-wise, equality
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) plus the caller's stop ids
    stream: bool = False
    arrival_time: float = field(default_factory=time.time)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0 (with return_logprob): prompt logprobs from there
    token_ids_logprob: list[int] = field(default_factory=list)  # with return_logprob: these ids' logprobs too
    cache_salt: str = ""
    deadline: float | None = None  # time.time() after which it ends as an abort
    priority: int = 0  # with --enable-priority-scheduling: larger goes first (SGLang's convention)
    waiting_since: float = 0.0  # when it last entered the waiting queue (arrival, or retraction)
    penalized: bool = False  # uses penalties: the model keeps state for its row (PenaltyInit)
    # structured output (scheduler_proc/grammar.py): the compile in progress,
    # then the matcher, advanced over every output token
    grammar_future: Any = None
    grammar: Any = None  # a grammar.ReqGrammar once compiled
    thinking: ThinkingBudget | None = None  # a thinking budget: forces the closing tag once spent
    draft_state: Any = None  # speculative decoding: a speculative.policy.DraftState once it drafts

    output_ids: list[int] = field(default_factory=list)
    # Its KV residency: written by CacheManager only (admit, alloc_tokens, trim,
    # alloc_decode, cache_unfinished, release), read everywhere else.
    req_pool_idx: int = 0  # row of req_to_token while resident, 0 when not
    kv_len: int = 0  # tokens whose KV is in the pool, or will be once the steps sent have run
    # the first cached_prefix_len of those are the prefix cache's, locked through
    # last_node (a radix_cache.TreeNode); the rest are this request's own
    cached_prefix_len: int = 0
    last_node: Any = None
    table_sync_len: int = 0  # the model's req_to_token row must get our first N slots
    window_from: int = 0  # with a window pool: its tokens before this have no window pages any more
    cache_hit_tokens: int = 0  # prompt tokens taken from the cache, not computed (reported as cached_tokens)
    already_computed: int = 0  # tokens this request has computed itself, at most
    pending_tokens: int = 0  # sampled in steps still in flight (overlap): the model has them
    admit_time: float | None = None  # first prefill start (queue time = admit - arrival)
    first_token_time: float = 0.0  # wall clock of the first output token (0: none yet)
    finish: FinishReason | None = None
    num_retractions: int = 0
    penalty_state_sent: bool = False  # its row's penalty state went with an extend since admission
    sent_len: int = 0  # output tokens already sent to the tokenizer process
    finish_sent: bool = False  # the final message went out
    # when return_logprob: one entry per output token
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # prompt logprobs: position p predicts prompt token p + 1; positions
    # logprob_start_len .. len(prompt) - 2 are computed, each exactly once, in
    # order (chunks; a retracted request keeps them and computes only the rest)
    input_logprob_next: int = 0  # the next position to ask the model for (set when sent)
    input_token_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs_sent: bool = False
    # token_ids_logprob's values, aligned with output_token_logprobs and
    # input_token_logprobs: per position, one per id
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float]] = field(default_factory=list)

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReq, eos_token_ids: list[int], vocab_size: int = 0) -> "Req":
        """`vocab_size`: the model's logits width (a thinking budget's mask row)."""
        sp = msg.sampling_params
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop.update(eos_token_ids)
        return cls(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=sp,
                   stop_token_ids=frozenset(stop), stream=msg.stream,
                   arrival_time=msg.arrival_time or time.time(),
                   return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
                   logprob_start_len=msg.logprob_start_len if msg.return_logprob else -1,
                   token_ids_logprob=list(msg.token_ids_logprob) if msg.return_logprob else [],
                   input_logprob_next=max(msg.logprob_start_len, 0),
                   cache_salt=msg.cache_salt, penalized=sp.penalized(), priority=msg.priority,
                   thinking=ThinkingBudget.from_spec(msg.thinking_budget, vocab_size) if msg.thinking_budget
                   else None)

    def __post_init__(self) -> None:
        self.waiting_since = self.waiting_since or self.arrival_time

    @property
    def wants_input_logprobs(self) -> bool:
        """Some prompt position's logprob is still to be computed."""
        return self.logprob_start_len >= 0 and self.input_logprob_next < len(self.origin_input_ids) - 1

    @property
    def prefix_limit(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the
        last (computed for its logits), and none past the first prompt position
        whose logprob is still wanted (a cached token is never recomputed)."""
        n = self.num_tokens - 1
        return min(n, self.input_logprob_next) if self.wants_input_logprobs else n

    def penalty_init(self, row: int) -> PenaltyInit:
        """What the model needs to (re)build this request's penalty state, as
        row `row` of a batch: everything is known at an extend (no token in flight)."""
        sp = self.sampling_params
        return PenaltyInit(
            row=row, output_ids=list(self.output_ids),
            prompt_ids=self.origin_input_ids if sp.repetition_penalty != 1.0 else [],
            frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty, min_new_tokens=sp.min_new_tokens,
            stop_ids=sorted(self.stop_token_ids) if sp.min_new_tokens > 0 else [],
            logit_bias=sp.logit_bias)

    def penalizes_next_token(self) -> bool:
        """A penalty applies to the token this request samples next (a
        min_new_tokens-only request stops needing its row once it has them)."""
        sp = self.sampling_params
        return bool(sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0
                    or sp.logit_bias) or \
            len(self.output_ids) + self.pending_tokens < sp.min_new_tokens

    @property
    def fill_ids(self) -> list[int]:
        """Everything the model must have seen to produce the next token."""
        return self.origin_input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known here (len(fill_ids)); a token still
        in flight (pending_tokens) is not one yet."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def state(self) -> ReqState:
        if self.finish is not None:
            return ReqState.FINISHED
        if self.grammar_future is not None:
            return ReqState.WAITING_FOR_GRAMMAR
        if self.req_pool_idx:
            return ReqState.RUNNING
        return ReqState.RETRACTED if self.num_retractions else ReqState.WAITING

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def aborted(self) -> bool:
        return isinstance(self.finish, FinishAbort)

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens 0 (SGLang's cache warm-up and prompt scoring): it ends
        after its prefill, by length, with no output token. Its last prefill
        step's sampled token counts as pending (so the overlap schedule never
        decodes it: finishes_with_pending) and is dropped when read."""
        return self.sampling_params.max_new_tokens == 0

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids)
                   - self.pending_tokens)

    def finishes_with_pending(self, context_len: int) -> bool:
        """A token still in flight ends this request by length, whatever its
        value: the overlap schedule leaves such a row out of the next step."""
        if not self.pending_tokens:
            return False
        n = len(self.output_ids) + self.pending_tokens
        return n >= self.sampling_params.max_new_tokens or \
            self.num_tokens + self.pending_tokens >= context_len

    def check_finished(self, context_len: int) -> None:
        """Set `finish` after a token was appended to output_ids."""
        last = self.output_ids[-1]
        if last in self.stop_token_ids or (self.grammar is not None and self.grammar.terminated):
            self.finish = FinishMatchedToken(last)
        elif len(self.output_ids) >= self.sampling_params.max_new_tokens or self.num_tokens >= context_len:
            self.finish = FinishLength(len(self.output_ids))

    @property
    def queue_time(self) -> float:
        """Seconds from arrival to the first prefill (so far, if still waiting)."""
        end = self.admit_time if self.admit_time is not None else time.time()
        return max(0.0, end - self.arrival_time)

    def abort(self, kind: AbortKind, message: str) -> None:
        self.finish = FinishAbort(kind, message)
