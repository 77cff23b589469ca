"""Runs another API's chat request (Anthropic's Messages, OpenAI's Responses)
through the chat completions path: the route translates its body into a chat
completions body, and this module checks it, applies the template (on the
tokenizer pool), and submits it, exactly as /v1/chat/completions does. One
path for validation, limits, grammars and the prefix cache; the routes differ
only in their JSON."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common.messages import FinishAbort, FinishMatchedStr, FinishReason
from tokenizer_proc.app_keys import MANAGER, MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.finish_json import abort_error
from tokenizer_proc.generation import Generation
from tokenizer_proc.grammar import check_grammars
from tokenizer_proc.openai_protocol import OpenAIInput, check_chat_request
from tokenizer_proc.reasoning import ReasoningParser, ReasoningSplitter, Split, attach_thinking_budget, reasoning_parser
from tokenizer_proc.request_output import RequestOutput
from tokenizer_proc.tokenizer import Tokenizer


@dataclass
class ChatRun:
    inp: OpenAIInput
    gen: Generation
    parser: ReasoningParser | None  # --reasoning-parser's, unless the request turned it off
    tokenizer: Tokenizer

    @property
    def out(self) -> RequestOutput:
        return self.gen.outputs[0]

    def _splitter(self) -> ReasoningSplitter | None:
        """A fresh splitter for this output (None: all of it is content)."""
        if self.parser is None:
            return None
        return ReasoningSplitter.for_prompt(self.parser, self.inp.specs[0].req.input_ids, self.tokenizer)

    def whole(self) -> Split:
        """The finished output's reasoning and answer."""
        splitter, text = self._splitter(), self.out.text
        return splitter.whole(text) if splitter is not None else Split(content=text)

    async def deltas(self) -> AsyncIterator[Split]:
        """The output's new text, split, as it comes; ends when it is finished
        (raises the abort's error for an aborted one)."""
        sent, splitter = 0, self._splitter()
        async for _ in self.gen.updates():
            out = self.out
            delta = out.text_since(sent)
            sent = out.text_len
            split = splitter.feed(delta) if splitter is not None else Split(content=delta)
            if out.done:
                if isinstance(out.finish_reason, FinishAbort):
                    raise abort_error(out.finish_reason)
                if splitter is not None:
                    split += splitter.flush()
            if split.reasoning or split.content:
                yield split


async def start_chat(request: web.Request, body: dict[str, Any], arrival: float) -> ChatRun:
    """Checks and submits a chat completions body (one choice); the caller
    aborts `run.gen` in a `finally`."""
    app = request.app
    tokenizer = app[TOKENIZER]
    pending = check_chat_request(body, app[MODEL_INFO], app[PROMPT_CHAR_LIMIT])
    inp = pending.finish(await app[TOKENIZER_POOL].run(pending.encode, tokenizer))
    attach_thinking_budget(inp, app[SERVER_ARGS].reasoning_parser, tokenizer)
    await check_grammars([spec.req.sampling_params.grammar for spec in inp.specs], app[SERVER_ARGS])
    gen = Generation(app[MANAGER], tokenizer, inp.specs, inp.stream, arrival, app[SERVER_ARGS].max_logprob_entries)
    gen.submit()
    return ChatRun(inp, gen, reasoning_parser(app[SERVER_ARGS], inp), tokenizer)


def finish_of(out: RequestOutput) -> FinishReason:
    """The finished output's reason; an abort raises its error."""
    reason = out.finish_reason
    if isinstance(reason, FinishAbort):
        raise abort_error(reason)
    assert reason is not None, "the output is not finished"
    return reason


def stopped_on_string(reason: FinishReason) -> str | None:
    """The stop string that ended the output, if one did."""
    return reason.text if isinstance(reason, FinishMatchedStr) else None
