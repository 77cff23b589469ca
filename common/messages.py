"""Every message that crosses a process boundary, in one module.

Messages are msgspec Structs encoded as msgpack with a type tag. Nothing is
ever pickled: a pickle on a socket is a remote-code-execution hole.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Union

import msgspec


class ForwardMode(enum.StrEnum):
    """What a step computes. Compare members (`is`, or the helpers), never strings."""

    EXTEND = "extend"  # new prompt tokens (a prefill, or a chunk of one) after a prefix in the pool
    DECODE = "decode"  # one token per row, after its last sampled one
    # an extend whose last `ForwardBatch.decode_rows` rows are running rows
    # decoding one token each (--enable-mixed-chunk): their decode step, run
    # in the same pass over the weights as the prefill
    MIXED = "mixed"
    # speculative decoding: an extend whose rows each run their last sampled
    # token and the drafts after it; every token is sampled, and each row
    # keeps the drafts its samples agree with plus the sample after them
    # (ForwardResult.accept_lens)
    VERIFY = "verify"

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        """Ragged rows after a prefix (`prefix_lens` is sent): EXTEND, MIXED or VERIFY."""
        return self is not ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object); text ""
    JSON_ANY = "json"  # any JSON value (SGLang's json_schema "$$ANY$$"); text ""
    REGEX = "regex"
    EBNF = "ebnf"  # xgrammar's EBNF (GBNF-style, root rule `root`)
    # xgrammar's structural tag (JSON text): free text and tagged regions, each tag's content
    # constrained (tool calls: tokenizer_proc/tool_calls/)
    STRUCTURAL_TAG = "structural_tag"


class Grammar(msgspec.Struct, frozen=True):
    """A constraint on the output: every token sampled keeps the text a prefix
    of a string the grammar accepts (scheduler_proc/grammar.py)."""

    kind: GrammarKind
    text: str = ""


class SamplingParams(msgspec.Struct):
    max_new_tokens: int = 128
    temperature: float = 1.0  # below 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    min_p: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # Penalties, applied by the model process (model_proc/penalties.py) to the
    # logits before sampling, in this order: repetition (HF/CTRL, over prompt
    # and output tokens), frequency and presence (OpenAI's, over output tokens),
    # logit_bias (token id -> added to its logit), then min_new_tokens (the
    # row's stop tokens masked until that many tokens were generated).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = {}
    stream_interval: int | None = None  # tokens between streamed chunks (None: --stream-interval)
    grammar: Grammar | None = None  # structured output: json_schema, regex, ebnf (one at most)

    def penalized(self) -> bool:
        """Uses anything the model process must keep per-row state for."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens > 0)


# ---- tokenizer_proc -> scheduler_proc -------------------------------------------------


class ThinkingBudgetSpec(msgspec.Struct, frozen=True):
    """A reasoning model's thinking budget (chat's thinking_budget): after
    `budget` thinking tokens the scheduler forces `end_ids` (the closing tag's
    tokens) as the next output tokens. Thinking is open from the first output
    token when `start_id` is -1, else only when the first output token is
    `start_id` (the opening tag); it ends when the model writes `end_ids`."""

    budget: int
    end_ids: list[int]
    start_id: int = -1


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    arrival_time: float = 0.0
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # with return_logprob: >= 0 asks for the logprobs of the prompt tokens from
    # this position on (-1: none); below len(input_ids)
    logprob_start_len: int = -1
    # with return_logprob: these ids' logprobs at every output (and asked-for
    # prompt) position (SGLang's token_ids_logprob: classification-style scoring)
    token_ids_logprob: list[int] = []
    # requests with different salts never share cached prefixes (a shared
    # prefix cache is a timing side channel between tenants)
    cache_salt: str = ""
    # seconds from arrival after which the request ends as an abort, wherever
    # it is (None: --request-timeout-s, if set)
    timeout_s: float | None = None
    # with --enable-priority-scheduling: larger is admitted first (and, with
    # --priority-preemption, may retract running requests of lower priority)
    priority: int = 0
    thinking_budget: ThinkingBudgetSpec | None = None  # scheduler_proc/thinking_budget.py


class AbortReq(msgspec.Struct, tag=True):
    """Drop request `rid` and free its KV (the client went away or asked for it)."""

    rid: str


class StopMatchedReq(msgspec.Struct, tag=True):
    """The tokenizer process ended request `rid` on the stop string (or stop
    regex) match `matched`, found in the text, which only it sees: the
    scheduler finishes it as a stop (its KV is freed into the prefix cache)."""

    rid: str
    matched: str


# Questions for the scheduler, one message each, answered by a SchedulerReply
# with the same query_id (scheduler_proc/queries.py answers them).


class StateQuery(msgspec.Struct, tag=True):
    """Its live state: queues, KV usage, counters."""

    query_id: str


class FlushCacheQuery(msgspec.Struct, tag=True):
    """Reset the prefix cache; refused while requests run or wait."""

    query_id: str


class TimelineQuery(msgspec.Struct, tag=True):
    """Recent request and step events (scheduler_proc/timeline.py)."""

    query_id: str
    since: float = 0.0  # events after this time.time()
    after_seq: int = 0  # events after this sequence number (a cursor)
    limit: int = 0  # at most this many events (0: the scheduler's bound)


SchedulerQuery = Union[StateQuery, FlushCacheQuery, TimelineQuery]


# ---- scheduler_proc -> tokenizer_proc -------------------------------------------------


class AbortKind(enum.Enum):
    """Why a request was ended before its time. The tokenizer process alone
    decides what each means for the client (its HTTP status, the JSON it
    shows: tokenizer_proc/finish_json.py)."""

    CLIENT_GONE = "client_gone"  # the client went away, or asked for the abort
    QUEUE_FULL = "queue_full"  # no room in the waiting queue, or waited past --queue-timeout-ms
    INVALID = "invalid"  # refused: it can never run here (its parameters, its length, its grammar)
    DEADLINE = "deadline"  # its timeout (or --request-timeout-s) ran out
    SHUTDOWN = "shutdown"  # the server stopped before it finished (--shutdown-timeout ran out)
    SERVER_DOWN = "server_down"  # a process of the server died: nothing in flight can finish
    SERVER_ERROR = "server_error"  # an internal failure (or a stop regex that took too long)


# Why a request finished (SGLang's FINISH_* classes). `type` is the family a
# client sees ("stop", "length", "abort").


class FinishMatchedToken(msgspec.Struct, tag=True, frozen=True):
    """Sampled a stop token (EOS, a stop_token_id, or the end of a grammar)."""

    type: ClassVar[str] = "stop"
    token: int


class FinishMatchedStr(msgspec.Struct, tag=True, frozen=True):
    """The tokenizer process matched a stop string (or stop regex) in the text."""

    type: ClassVar[str] = "stop"
    text: str


class FinishLength(msgspec.Struct, tag=True, frozen=True):
    """max_new_tokens reached, or the context is full."""

    type: ClassVar[str] = "length"
    length: int


class FinishAbort(msgspec.Struct, tag=True, frozen=True):
    """Ended before its time: by the client, a deadline, a refusal at
    admission, the server stopping, an error."""

    type: ClassVar[str] = "abort"
    kind: AbortKind
    message: str


FinishReason = Union[FinishMatchedToken, FinishMatchedStr, FinishLength, FinishAbort]


class BatchTokenOut(msgspec.Struct, tag=True):
    """Per row: the tokens produced since the last message for that rid;
    `finished_reasons[i]` is None while the request runs."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    num_retractions: list[int]
    # per row, for the new tokens of rows that asked for logprobs (else empty lists)
    output_token_logprobs: list[list[float]] = []
    output_top_logprobs: list[list[list[tuple[float, int]]]] = []  # (logprob, token id)
    # per row, in the first message of a request that asked for prompt logprobs
    # (logprob_start_len >= 0), else empty: one entry per prompt token from
    # logprob_start_len on, the first None (SGLang's layout: that position's
    # predictor is not computed)
    input_token_logprobs: list[list[float | None]] = []
    input_top_logprobs: list[list[list[tuple[float, int]] | None]] = []
    # per row, for rows with token_ids_logprob: per new token (per prompt
    # position, the first None, as above) the logprob of each of those ids
    output_token_ids_logprobs: list[list[list[float]]] = []
    input_token_ids_logprobs: list[list[list[float] | None]] = []
    queue_times: list[float] = []  # seconds from arrival to the first prefill
    first_token_times: list[float] = []  # wall-clock time.time() of the first output token
    # with --speculative-algorithm (else empty): per row, the verify steps it
    # drafted in (SGLang's spec_verify_ct) and the drafts they kept
    spec_verify_ct: list[int] = []
    spec_accepted_tokens: list[int] = []


class SchedulerReply(msgspec.Struct, tag=True):
    query_id: str
    ok: bool
    data: dict[str, Any] = {}
    message: str = ""


class SchedulerHeartbeat(msgspec.Struct, tag=True):
    """Sent by the scheduler every scheduler_proc.watchdog.HEARTBEAT_S while
    it runs, idle or not, even while it waits for the model: the front end's
    sign that the engine answers (/health, its watchdog)."""

    # seconds the model has not answered the oldest step sent to it (0: none out)
    model_silent_s: float = 0.0
    # set in the scheduler's last message when its watchdog stops the server: why
    watchdog_error: str = ""


# ---- scheduler_proc <-> model_proc ----------------------------------------------------

# In a decode batch's input_ids: "the token this row sampled at its last step".
# With the overlap schedule the scheduler sends step t+1 before it has read
# step t's result; the model process keeps each row's last sampled token.
FUTURE_TOKEN = -1


class PenaltyInit(msgspec.Struct):
    """(Re)builds the penalty state of one row of a ForwardBatch, at the row's
    first extend after its request was admitted (or re-admitted after a
    retraction): the model process keeps it per req_to_token row and adds each
    token it samples for the row. The token history comes from the scheduler,
    not from the forward: a prefix served by the prefix cache is never
    recomputed."""

    row: int  # position in the batch
    output_ids: list[int]  # tokens generated so far (a retracted request has some)
    prompt_ids: list[int]  # sent only when repetition_penalty != 1 (it counts the prompt too)
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_new_tokens: int
    stop_ids: list[int]  # masked until min_new_tokens were generated (sent only when > 0)
    logit_bias: dict[int, float]


class ForwardBatch(msgspec.Struct, tag=True):
    """One step's work for the model, O(batch) in size (plus the prompt tokens of
    an extend). The model keeps `req_to_token` itself and updates it from
    `req_pool_indices`, `prefix_lens`/`seq_lens` and `out_cache_loc`.

    EXTEND: row i has `seq_lens[i] - prefix_lens[i]` new tokens, laid out flat
    in `input_ids`; its first `prefix_lens[i]` tokens are already in the KV
    pool. DECODE: one new token per row (`prefix_lens` is empty; the prefix is
    `seq_lens[i] - 1`). MIXED: an extend whose last `decode_rows` rows decode
    one token each. A decoding row's input id may be FUTURE_TOKEN, which the
    model replaces with the row's last sampled token. VERIFY: an extend whose
    row i runs its last sampled token and then its drafts; each new token is
    sampled as if it were the row's next (token j with sample step
    `sample_steps[i] + j`), so the rows' sampling lists apply to each of their
    tokens (and `grammar_rows` index tokens, each with its own mask). A
    penalized row of a VERIFY runs one token (no drafts); no penalty inits or
    prompt logprobs go with one.
    `out_cache_loc` holds the KV slot of every new token, aligned with
    `input_ids`. `table_rows`/`table_lens`/`table_slots` rewrite rows of the
    model's `req_to_token` before the step: row `table_rows[i]` gets, for its
    first `table_lens[i]` positions, the next `table_lens[i]` entries of the
    flat `table_slots`. The scheduler sends them when it changed a row's
    prefix itself (a request starting from cached KV that another request
    computed, or moved onto the cache's copy of its own tokens). The sampling lists hold one entry per row; `seeds[i]` is -1
    for an unseeded row; `sample_steps[i]` is the number of tokens row i has
    generated so far (a seeded row's draw depends only on seed and step).
    Penalties: `penalty_inits` (re)build rows' state before this step;
    `penalty_rows` are the positions of the rows whose penalties apply to this
    step's token (only rows that use them and keep the token: not a
    mid-prompt chunk), so a batch without penalties pays nothing for them.
    """

    forward_mode: ForwardMode
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    input_ids: list[int]
    out_cache_loc: list[int]
    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    seeds: list[int]
    sample_steps: list[int]
    decode_rows: int = 0  # MIXED: how many of the last rows decode one token (0 otherwise)
    return_logprob: bool = False  # some row wants the logprob of its sampled token
    top_logprobs_nums: list[int] = []  # per row: how many top logprobs (0: none)
    table_rows: list[int] = []
    table_lens: list[int] = []
    table_slots: list[int] = []
    # KV rows to copy, every layer's K and V, before anything the step writes:
    # slot kv_copy_src[i] into kv_copy_dst[i]. A prefix match that ends inside
    # a page gives its request those rows (fewer than a page) in a page of
    # its own; the table rewrite above already maps its positions to dst.
    kv_copy_src: list[int] = []
    kv_copy_dst: list[int] = []
    # A model with a window pool (scheduler_proc/window_pool.py): pages of it
    # paired with full-pool pages since the last step, flattened (full page,
    # window page, ...), applied in order before the copies above
    window_pages: list[int] = []
    penalty_rows: list[int] = []
    penalty_inits: list[PenaltyInit] = []
    # Prompt logprobs (extend only), for the rows that asked for them: row
    # `input_logprob_rows[j]` wants the logits of its new tokens from offset
    # `input_logprob_starts[j]` on, one per entry of `input_logprob_targets[j]`:
    # the token each of those positions predicts (the next prompt token, which
    # may lie in a later chunk, so the scheduler names it).
    input_logprob_rows: list[int] = []
    input_logprob_starts: list[int] = []
    input_logprob_targets: list[list[int]] = []
    # per row (empty when no row asks): the ids whose logprobs the row wants at
    # its sampled position, and at its input_logprob positions
    token_ids_logprobs: list[list[int]] = []
    # Structured output: row `grammar_rows[j]` may sample only the tokens whose
    # bit is set in row j of `grammar_bitmask`, int32 words little-endian,
    # ceil(vocab_size / 32) per row, bit t % 32 of word t // 32 for token t
    # (xgrammar's layout). Filled by the scheduler, which owns the matchers.
    grammar_rows: list[int] = []
    grammar_bitmask: bytes = b""


class ForwardResult(msgspec.Struct, tag=True):
    next_token_ids: list[int]  # one per row; VERIFY: one per input token, row after row
    # VERIFY: per row, how many of its sampled tokens it keeps (at least 1):
    # its drafts up to the first its samples disagree with, then that sample
    accept_lens: list[int] = []
    forward_time: float = 0.0  # seconds the model spent on this step
    # filled when ForwardBatch.return_logprob: log-softmax of the raw logits,
    # aligned with next_token_ids (VERIFY: per input token)
    next_token_logprobs: list[float] = []
    top_logprob_ids: list[list[int]] = []  # per row, top_logprobs_nums[i] entries
    top_logprob_vals: list[list[float]] = []
    # per entry of ForwardBatch.input_logprob_rows: the logprob of each target,
    # and, when the row's top_logprobs_nums > 0, each position's top-n
    input_token_logprobs: list[list[float]] = []
    input_top_logprob_vals: list[list[list[float]]] = []
    input_top_logprob_ids: list[list[list[int]]] = []
    # ForwardBatch.token_ids_logprobs' values: per row, and per entry of
    # input_logprob_rows per position (empty for a row that asked none)
    token_ids_logprobs: list[list[float]] = []
    input_token_ids_logprobs: list[list[list[float]]] = []


# ---- any child -> launch.py -----------------------------------------------------------


class ModelInfo(msgspec.Struct):
    """What the model process found when it loaded; the other processes size
    their limits from it."""

    model_path: str  # resolved Hugging Face folder (a GGUF is converted to one)
    tokenizer_path: str
    served_model_name: str
    context_len: int
    max_total_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    kv_cache_bytes: int
    cpu_threads: int = 0  # the model process's OpenMP threads on a CPU (0 on a GPU)
    # sliding-window layers' own pool (0: none, they are in the full pool): its
    # slots, and the largest window of the model's layers
    window_pool_tokens: int = 0
    sliding_window: int = 0
    # with --speculative-algorithm: a step's seconds ~ fixed + per token x tokens,
    # measured at start-up (ModelRunner.measure_step_cost); (0, 0) when not measured
    step_cost: tuple[float, float] = (0.0, 0.0)


class ReadyMsg(msgspec.Struct, tag=True):
    proc: str
    pid: int
    model_info: ModelInfo | None = None


class IpcPaths(msgspec.Struct):
    """ipc:// endpoints, all inside one private (0700) temporary folder."""

    scheduler_input: str  # tokenizer -> scheduler (requests, aborts)
    tokenizer_input: str  # scheduler -> tokenizer (token outputs)
    model_input: str  # scheduler -> model (ForwardBatch)
    model_output: str  # model -> scheduler (ForwardResult)
    launcher: str  # children -> launch.py (ReadyMsg)

    @staticmethod
    def in_dir(folder: str) -> "IpcPaths":
        return IpcPaths(
            scheduler_input=f"ipc://{folder}/scheduler_input",
            tokenizer_input=f"ipc://{folder}/tokenizer_input",
            model_input=f"ipc://{folder}/model_input",
            model_output=f"ipc://{folder}/model_output",
            launcher=f"ipc://{folder}/launcher",
        )


ToSchedulerMsg = Union[TokenizedGenerateReq, AbortReq, StopMatchedReq, SchedulerQuery]
ToTokenizerMsg = Union[BatchTokenOut, SchedulerReply, SchedulerHeartbeat]
ToModelMsg = ForwardBatch
FromModelMsg = ForwardResult
ToLauncherMsg = ReadyMsg
