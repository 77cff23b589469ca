"""Structured output: grammars compiled off the loop, one matcher per request.

As SGLang does with xgrammar: a request with a grammar (`json_schema`,
`regex`, `ebnf`, or OpenAI's `json_object`) waits in the scheduler's grammar
queue while a worker thread compiles it; the loop moves it to the waiting
queue when the compile is done, and other requests run meanwhile. Once
admitted, each step the scheduler fills the request's row of a token bitmask
from its matcher (the tokens that keep the output a prefix of something the
grammar accepts), the model process sets every other token's logit to -inf
before sampling, and the matcher accepts the sampled token when the result
comes back. The request finishes when the matcher accepts a stop token (the
grammar is complete and the model ended it).

Compiles, so that no client's grammars hold everyone else's behind them
(`GrammarBackend`):
- the cache comes first: a grammar compiled before (kept by a hash of its
  text, LRU, bounded by --grammar-cache-bytes of xgrammar's own size count)
  never waits; the n samples of one request, or the same grammar from many
  clients, share one compile;
- --grammar-compile-threads compile at once (xgrammar releases the GIL), the
  smallest grammar first: one counts as if it had arrived len(text) /
  HANDICAP_CHARS_PER_S seconds later, so a one-field schema passes queued
  large ones, and a large one waits behind later small ones for a bounded time;
- a compile running longer than --grammar-compile-timeout-s fails its
  requests then (a 400 saying so), and the grammar is refused at once when
  sent again. xgrammar cannot stop a compile, so it runs on to its end while
  a fresh thread takes its place in the pool (at most as many such threads
  as the pool's: past that, the pool shrinks until one ends). The budget
  bounds a request's wait and a slow compile's hold on the pool; the front
  end's size bounds (tokenizer_proc/grammar.py) bound the compile itself;
- a compile whose requests all left (aborted, past their deadline) before it
  started is dropped from the queue.
The front end has already refused grammars over a size bound or that do not
parse; a compile error here still fails only its requests.

The matcher lives with the request, not with its KV: a retracted request
keeps it, already advanced over the tokens it keeps, so nothing is replayed.
With the overlap schedule, a constrained row's mask for step t+1 needs the
token of step t, so the scheduler reads the step in flight before it builds a
step with constrained rows (scheduler.step): those steps run without overlap.
"""

from __future__ import annotations

import atexit
import hashlib
import heapq
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.messages import Grammar, GrammarKind
from common.server_args import ServerArgs
from common.tokenizer_files import find_tokenizer, load_hf_tokenizer

logger = logging.getLogger(__name__)

HANDICAP_CHARS_PER_S = 10_000  # queue order: a grammar of c characters counts as arriving c / this s later
MAX_REMEMBERED_FAILURES = 256  # grammars that failed (a short message each), refused again at once
IDLE_THREAD_EXIT_S = 30.0  # a compile thread with nothing to do ends (a later grammar starts another)


class GrammarCompileError(Exception):
    """A compile's failure, as its requests' 400 says it."""


@dataclass(frozen=True, slots=True)
class GrammarFailure:
    """Why a grammar cannot constrain its requests (their 400's message)."""

    message: str


@dataclass(eq=False)
class CompileJob:
    """One grammar's compile, shared by every request waiting for it; a
    request holds it (Req.grammar_future) until the grammar is ready."""

    key: bytes  # hash of kind and text
    order: tuple[float, int]  # (handicapped arrival, sequence): the queue's order
    future: Future = field(default_factory=Future)  # the xgrammar.CompiledGrammar, or an exception
    grammar: Grammar | None = None  # held until a thread takes the job
    waiters: int = 0  # requests holding it
    started_at: float | None = None  # time.monotonic() when a thread took it
    overdue: bool = False  # failed past its budget while its thread compiles on

    def __lt__(self, other: CompileJob) -> bool:
        return self.order < other.order


def grammar_key(grammar: Grammar) -> bytes:
    return hashlib.sha256(grammar.kind.value.encode() + b"\0" + grammar.text.encode()).digest()


class GrammarBackend:
    """The compile queue, its threads and the compiled-grammar cache. Threads
    start, and the tokenizer's vocabulary is loaded, on the first grammar, so
    a server that never sees one pays nothing."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 args: ServerArgs) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self.num_threads = args.grammar_compile_threads
        self.timeout_s = args.grammar_compile_timeout_s
        self.cache_limit_bytes = args.grammar_cache_bytes
        self._lock = threading.Condition()  # guards everything below; the threads wait on it
        self._pending: list[CompileJob] = []  # heap by CompileJob.order
        self._jobs: dict[bytes, CompileJob] = {}  # queued or compiling, by key
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()  # LRU: key -> xgrammar.CompiledGrammar
        self._failed: OrderedDict[bytes, str] = OrderedDict()  # LRU: key -> message
        self.cached_bytes = 0
        self._seq = 0
        self._threads: set[threading.Thread] = set()
        self._overdue = 0  # threads compiling past the budget (their place taken by a fresh one)
        self._closed = False
        self._tokenizer_info: Any = None  # xgrammar.TokenizerInfo, shared by the threads' compilers
        self._info_lock = threading.Lock()  # not _lock: the loop must not wait for the vocabulary
        self._local = threading.local()  # one xgrammar.GrammarCompiler per thread

    # ---- the loop's side ------------------------------------------------------------

    def compile(self, grammar: Grammar) -> CompileJob:
        """The compile of `grammar` for one more request: done at once if cached."""
        key = grammar_key(grammar)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = CompileJob(key, (time.monotonic() + len(grammar.text) / HANDICAP_CHARS_PER_S, self._seq))
                self._seq += 1
                if key in self._compiled:
                    self._compiled.move_to_end(key)
                    job.future.set_result(self._compiled[key])
                elif key in self._failed:
                    self._failed.move_to_end(key)
                    job.future.set_exception(GrammarCompileError(self._failed[key]))
                else:
                    job.grammar = grammar
                    self._jobs[key] = job
                    heapq.heappush(self._pending, job)
                    self._start_threads()
                    self._lock.notify()
            job.waiters += 1
            return job

    def outcome(self, job: CompileJob) -> Any | GrammarFailure | None:
        """The compiled grammar, why it failed, or None: still compiling or queued.
        A compile past its budget fails here, for every request waiting on it."""
        if not job.future.done() and job.started_at is not None \
                and time.monotonic() - job.started_at > self.timeout_s:
            with self._lock:
                if not job.future.done():
                    message = (f"grammar compile took longer than {self.timeout_s:g} s "
                               "(--grammar-compile-timeout-s)")
                    logger.warning("%s: refusing its requests; its thread runs on until it ends", message)
                    job.future.set_exception(GrammarCompileError(message))
                    self._remember_failure(job.key, message)
                    if self._jobs.get(job.key) is job:
                        del self._jobs[job.key]  # the same grammar again meets the failure
                    job.overdue = True
                    self._overdue += 1
                    self._start_threads()
        if not job.future.done():
            return None
        error = job.future.exception()
        if error is not None:
            return GrammarFailure(str(error))
        return job.future.result()

    def release(self, job: CompileJob) -> None:
        """A request waiting on `job` left: with none left, a queued compile is dropped."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.started_at is not None or job.future.done():
                return
            self._pending.remove(job)
            heapq.heapify(self._pending)
            job.grammar = None
            job.future.cancel()
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]

    def is_cached(self, grammar: Grammar) -> bool:
        return grammar_key(grammar) in self._compiled

    @property
    def queued(self) -> int:
        """Compiles waiting for a thread."""
        return len(self._pending)

    def shutdown(self) -> None:
        """Drop the queue and wait for the compiles running: a thread still
        inside xgrammar when the interpreter exits would abort the process."""
        with self._lock:
            self._closed = True
            for job in self._pending:
                job.future.cancel()
            self._pending.clear()
            self._lock.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    # ---- the threads' side ---------------------------------------------------------

    def _start_threads(self) -> None:
        """Keep num_threads threads on the queue, besides those compiling past
        the budget; never more than twice num_threads in all."""
        _live_backends.add(self)
        while len(self._threads) - self._overdue < self.num_threads \
                and len(self._threads) < 2 * self.num_threads:
            # daemon: a process that exits does not wait for a compile it cannot stop
            thread = threading.Thread(target=self._work, name=f"grammar-compile-{self._seq}", daemon=True)
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        try:  # before the first job: loading the vocabulary is not a compile's time
            self._get_compiler()
        except Exception:  # a job meets the error again, and fails with it
            logger.exception("the grammar backend cannot start")
        while True:
            with self._lock:
                if not self._pending and not self._closed:
                    self._lock.wait(IDLE_THREAD_EXIT_S)
                if self._closed or not self._pending:
                    self._threads.discard(threading.current_thread())
                    return
                job = heapq.heappop(self._pending)
                job.started_at = time.monotonic()
                grammar, job.grammar = job.grammar, None
            assert grammar is not None
            compiled: Any = None
            error: GrammarCompileError | None = None
            try:
                compiled = self._compile(grammar)
            except Exception as e:  # xgrammar's reason: fails only this grammar's requests
                error = GrammarCompileError(f"invalid grammar: {e}")
            with self._lock:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                if job.overdue:  # its requests were failed at the budget; a fresh thread took its place
                    self._overdue -= 1
                    if len(self._threads) - self._overdue > self.num_threads:
                        self._threads.discard(threading.current_thread())
                        return
                    continue
                if job.future.done():
                    continue
                if error is not None:
                    self._remember_failure(job.key, str(error))
                    job.future.set_exception(error)
                else:
                    self._remember(job.key, compiled)
                    job.future.set_result(compiled)

    def _remember(self, key: bytes, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.cache_limit_bytes:
            return  # used by its own requests only
        self._compiled[key] = compiled
        self.cached_bytes += size
        while self.cached_bytes > self.cache_limit_bytes:
            _, old = self._compiled.popitem(last=False)
            self.cached_bytes -= int(old.memory_size_bytes)

    def _remember_failure(self, key: bytes, message: str) -> None:
        self._failed[key] = message[:512]
        while len(self._failed) > MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def _compile(self, grammar: Grammar) -> Any:  # -> xgrammar.CompiledGrammar
        compiler = self._get_compiler()
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            # no free whitespace between JSON tokens: small models otherwise
            # fill a constrained answer with newlines until max_new_tokens
            return compiler.compile_json_schema(grammar.text, any_whitespace=False)
        if grammar.kind is GrammarKind.JSON_OBJECT:  # as SGLang: the schema of any object
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if grammar.kind is GrammarKind.JSON_ANY:
            return compiler.compile_builtin_json_grammar()
        if grammar.kind is GrammarKind.REGEX:
            return compiler.compile_regex(grammar.text)
        if grammar.kind is GrammarKind.STRUCTURAL_TAG:
            return compiler.compile_structural_tag(grammar.text)
        return compiler.compile_grammar(grammar.text)

    def _get_compiler(self) -> Any:  # -> xgrammar.GrammarCompiler, this thread's
        compiler = getattr(self._local, "compiler", None)
        if compiler is None:
            import xgrammar as xgr

            # one compiler per thread, each single-threaded, xgrammar's own
            # (unbounded) cache off: the model process has the cores, and our
            # cache is the bounded one
            compiler = xgr.GrammarCompiler(self._get_tokenizer_info(), max_threads=1, cache_enabled=False)
            self._local.compiler = compiler
        return compiler

    def _get_tokenizer_info(self) -> Any:
        with self._info_lock:  # the first thread loads it; the others wait for it
            if self._tokenizer_info is None:
                import xgrammar as xgr

                kind, folder = find_tokenizer(self.tokenizer_path)
                if kind != "hf":
                    raise ValueError("structured output needs a Hugging Face tokenizer (tokenizer.json)")
                hf = load_hf_tokenizer(folder)
                self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                logger.info("grammar backend ready (xgrammar, vocabulary %d)", self.vocab_size)
            return self._tokenizer_info


_live_backends: weakref.WeakSet[GrammarBackend] = weakref.WeakSet()


@atexit.register
def _finish_compiles() -> None:
    for backend in list(_live_backends):
        backend.shutdown()


class ReqGrammar:
    """One request's matcher: where its output stands in the grammar."""

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The matcher accepted a stop token: the output is complete."""
        return bool(self.matcher.is_terminated())

    def allowed_prefix(self, drafts: list[int]) -> int:
        """Speculative decoding: how many leading drafts the grammar allows,
        stopping before one it rejects or one that would complete it (a stop
        token is left for the step to sample). The matcher is left as it was."""
        n = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                n -= 1
                self.matcher.rollback(1)
                break
        if n:
            self.matcher.rollback(n)
        return n


def fill_draft_bitmask(bitmask, at: int, g: ReqGrammar, drafts: list[int]) -> None:
    """A verify step's masks for one grammar row, into bitmask rows at, at + 1,
    ...: the allowed tokens before its first draft, then after each draft in
    turn (1 + len(drafts) rows; the drafts are ones allowed_prefix passed).
    The matcher is left as it was: the kept tokens are accepted when the
    result is read."""
    g.matcher.fill_next_token_bitmask(bitmask, at)
    for token in drafts:
        at += 1
        assert g.matcher.accept_token(token), "a draft the grammar rejects"
        g.matcher.fill_next_token_bitmask(bitmask, at)
    if drafts:
        g.matcher.rollback(len(drafts))


def new_bitmask(rows: int, vocab_size: int, for_grammar: bool) -> Any:
    """`rows` rows of ForwardBatch.grammar_bitmask's layout, every token
    allowed: xgrammar's own (a torch tensor) where a matcher fills some row
    (xgrammar is loaded then), else a numpy array (a spent thinking budget's
    forced token alone needs neither xgrammar nor torch in this process)."""
    if for_grammar:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, vocab_size)
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def fill_bitmask(grammars: list[ReqGrammar]) -> bytes:
    """The allowed-token bitmask of each grammar's next token, one row each
    (ForwardBatch.grammar_bitmask's layout)."""
    bitmask = new_bitmask(len(grammars), grammars[0].vocab_size, for_grammar=True)
    for i, g in enumerate(grammars):
        g.matcher.fill_next_token_bitmask(bitmask, i)
    return np.asarray(bitmask).tobytes()
