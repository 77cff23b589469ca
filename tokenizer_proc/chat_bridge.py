"""Runs another API's chat request (Anthropic's Messages, OpenAI's Responses)
through the chat completions path: the route translates its body into a chat
completions body, and this module checks it, applies the template (on the
tokenizer pool), and submits it, exactly as /v1/chat/completions does. One
path for validation, limits, grammars and the prefix cache; the routes differ
only in their JSON.

With tools the content is read for calls by the request's tool-call parser,
as chat completions reads it: `answer()` (whole) and `pieces()` (streamed)
give the same events (tool_calls/base.py), so a stream adds up to the whole
answer."""

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
from tokenizer_proc.tool_calls.base import Event, ParsedMessage, Text
from tokenizer_proc.tools import check_tool_schemas


@dataclass
class Piece:
    """A streamed step: new reasoning, and the content's events (Text, or a
    call's start, argument fragments and end)."""
    reasoning: str
    events: list[Event]


@dataclass
class Answer:
    """A whole answer: its reasoning, and its content's events in order."""
    reasoning: str
    events: list[Event]

    @property
    def parsed(self) -> ParsedMessage:
        """The content and calls, added up."""
        return ParsedMessage().add(self.events)


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

    def answer(self) -> Answer:
        """The finished output's reasoning, content and (with tools) calls."""
        split = self.whole()
        if self.inp.tools is None:
            return Answer(split.reasoning, [Text(split.content)] if split.content else [])
        parser = self.inp.tools.new_parser()
        return Answer(split.reasoning, parser.feed(split.content) + parser.finish())

    async def _splits(self) -> AsyncIterator[tuple[Split, bool]]:
        """Every update's new text, split, and whether it is the last
        (raises the abort's error for an aborted output)."""
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
            yield split, out.done

    async def pieces(self) -> AsyncIterator[Piece]:
        """The output as it comes, its content as events (held back while a
        call's start is undecided); the events add up to `answer()`'s."""
        parser = self.inp.tools.new_parser() if self.inp.tools is not None else None
        async for split, done in self._splits():
            if parser is None:
                events: list[Event] = [Text(split.content)] if split.content else []
            else:
                events = parser.feed(split.content) if split.content else []
                if done:
                    events += parser.finish()
            if split.reasoning or events:
                yield Piece(split.reasoning, events)


async def start_chat(request: web.Request, body: dict[str, Any], arrival: float) -> ChatRun:
    """Checks and submits a chat completions body (one choice); the caller
    aborts `run.gen` in a `finally`."""
    app = request.app
    tokenizer = app[TOKENIZER]
    pending = check_chat_request(body, app[MODEL_INFO], app[PROMPT_CHAR_LIMIT], tool_parser=tool_parser_of(app))
    if pending.tools is not None:
        await check_tool_schemas(pending.tools, app[SERVER_ARGS])
    inp = pending.finish(await app[TOKENIZER_POOL].run(pending.encode, tokenizer))
    attach_thinking_budget(inp, app[SERVER_ARGS].reasoning_parser, tokenizer)
    await check_grammars([spec.req.sampling_params.grammar for spec in inp.specs], app[SERVER_ARGS])
    gen = Generation(app[MANAGER], tokenizer, inp.specs, inp.stream, arrival, app[SERVER_ARGS].max_logprob_entries)
    gen.submit()
    return ChatRun(inp, gen, reasoning_parser(app[SERVER_ARGS], inp), tokenizer)


def tool_parser_of(app: web.Application) -> str | None:
    """The server's tool-call format, as chat completions picks it: the flag,
    else the one the chat template implies (None: it cannot read calls)."""
    return app[SERVER_ARGS].tool_call_parser or getattr(app[TOKENIZER], "implied_tool_parser", None)


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
