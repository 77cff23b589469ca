"""Structured output: grammars compiled off the loop, one matcher per request.

As SGLang does with xgrammar: a request with a grammar (`json_schema`,
`regex`, `ebnf`, or OpenAI's `json_object`) waits in the scheduler's grammar
queue while a worker thread compiles it (cached by grammar text, so the n
samples of one request, or a schema many clients send, compile once); the
loop moves it to the waiting queue when the compile is done, and other
requests run meanwhile. Once admitted, each step the scheduler fills the
request's row of a token bitmask from its matcher (the tokens that keep the
output a prefix of something the grammar accepts), the model process sets
every other token's logit to -inf before sampling, and the matcher accepts
the sampled token when the result comes back. The request finishes when the
matcher accepts a stop token (the grammar is complete and the model ended it).

The matcher lives with the request, not with its KV: a retracted request
keeps it, already advanced over the tokens it keeps, so nothing is replayed.
With the overlap schedule, a constrained row's mask for step t+1 needs the
token of step t, so the scheduler reads the step in flight before it builds a
step with constrained rows (scheduler.step): those steps run without overlap.

The tokenizer process has already refused grammars that do not parse (before
anything runs); a compile error here still fails only its request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from common.messages import Grammar, GrammarKind
from common.tokenizer_files import find_tokenizer, load_hf_tokenizer

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (a JSON schema's is ~50 KB to a few MB)


class GrammarBackend:
    """Compiles grammars on a worker thread; the tokenizer's vocabulary is
    loaded on the first grammar, so a server that never sees one pays nothing."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler = None  # xgrammar.GrammarCompiler, built in the worker
        self._cache: OrderedDict[Grammar, Future] = OrderedDict()

    def compile(self, grammar: Grammar) -> Future:
        """A future of the compiled grammar (xgrammar.CompiledGrammar)."""
        future = self._cache.get(grammar)
        if future is not None:  # a grammar that failed fails again: kept too
            self._cache.move_to_end(grammar)
            return future
        future = self._executor.submit(self._compile, grammar)
        self._cache[grammar] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _compile(self, grammar: Grammar):  # -> xgrammar.CompiledGrammar
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
        return compiler.compile_grammar(grammar.text)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            kind, folder = find_tokenizer(self.tokenizer_path)
            if kind != "hf":
                raise ValueError("structured output needs a Hugging Face tokenizer (tokenizer.json)")
            hf = load_hf_tokenizer(folder)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # one compile thread: the model process has the cores
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            logger.info("grammar backend ready (xgrammar, vocabulary %d)", self.vocab_size)
        return self._compiler

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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


def fill_bitmask(grammars: list[ReqGrammar]) -> bytes:
    """The allowed-token bitmask of each grammar's next token, one row each
    (ForwardBatch.grammar_bitmask's layout)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), grammars[0].vocab_size)
    for i, g in enumerate(grammars):
        g.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask.numpy().tobytes()
