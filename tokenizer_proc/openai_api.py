"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, so the `openai` client (and tools built on it) work unchanged.

Each request becomes a `Generation` (n samples x prompts, choice k is output
k); a shaper turns its outputs into OpenAI's response or stream chunks. An
aborted output is an error, not a choice: a 400 before the headers, an error
event in the stream after them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from common.messages import FinishAbort
from tokenizer_proc.app_keys import MANAGER, MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.errors import json_response
from tokenizer_proc.finish_json import abort_error, matched
from tokenizer_proc.generation import Generation, worker_pool
from tokenizer_proc.grammar import check_grammars
from tokenizer_proc.logprobs import (TokenTexts, chat_logprobs, completion_logprobs, encoded_list, large_answer,
                                     too_large_for_the_loop)
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.openai_protocol import OpenAIInput, check_chat_request, check_completion_request
from tokenizer_proc.reasoning import (ReasoningParser, ReasoningSplitter, Split, attach_thinking_budget,
                                      reasoning_parser)
from tokenizer_proc.request_output import RequestOutput
from tokenizer_proc.sse import stream_events
from tokenizer_proc.tool_output import StreamedCalls, finish_reason_with_calls
from tokenizer_proc.tool_output import message as tool_message
from tokenizer_proc.tools import check_tool_schemas
from tokenizer_proc.validation import parse_json_object

STARTED = int(time.time())


def served_model_name(app: web.Application) -> str:
    info = app[MODEL_INFO]
    return app[SERVER_ARGS].served_model_name or info.served_model_name or info.model_path or "default"


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app)]})


async def retrieve_model(request: web.Request) -> web.Response:
    card = _model_card(request.app)
    if request.match_info["model"] != card["id"]:
        raise web.HTTPNotFound(reason=f"the model {request.match_info['model']!r} does not exist")
    return json_response(card)


def _model_card(app: web.Application) -> dict[str, Any]:
    info = app[MODEL_INFO]
    return {"id": served_model_name(app), "object": "model", "created": STARTED, "owned_by": "batchserve",
            "root": info.model_path, "max_model_len": info.context_len}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    tokenizer, info = request.app[TOKENIZER], request.app[MODEL_INFO]
    arrival = time.perf_counter()
    body = parse_json_object(await read_body(request))
    args = request.app[SERVER_ARGS]
    if chat:
        parser = args.tool_call_parser or getattr(tokenizer, "implied_tool_parser", None)
        pending = check_chat_request(body, info, request.app[PROMPT_CHAR_LIMIT], tool_parser=parser)
        if pending.tools is not None:
            await check_tool_schemas(pending.tools, args)
    else:
        pending = check_completion_request(body, info, request.app[PROMPT_CHAR_LIMIT])
    inp = pending.finish(await request.app[TOKENIZER_POOL].run(pending.encode, tokenizer))
    attach_thinking_budget(inp, request.app[SERVER_ARGS].reasoning_parser, tokenizer)
    await check_grammars([spec.req.sampling_params.grammar for spec in inp.specs],
                         request.app[SERVER_ARGS])
    shaper = ChatShaper(inp, served_model_name(request.app), TokenTexts(tokenizer),
                        reasoning_parser(request.app[SERVER_ARGS], inp)) if chat else \
        CompletionShaper(inp, served_model_name(request.app), TokenTexts(tokenizer))
    gen = Generation(request.app[MANAGER], tokenizer, inp.specs, inp.stream, arrival,
                     request.app[SERVER_ARGS].max_logprob_entries)
    gen.submit()
    try:
        if inp.stream:
            await gen.admitted()
            return await stream_events(request, shaper.chunks(gen), inp.request_id)
        await gen.wait()
        if not large_answer(gen.outputs):
            return json_response(shaper.response(gen.outputs))
        body = await asyncio.get_running_loop().run_in_executor(
            worker_pool(), lambda: msgspec.json.encode(shaper.encoded(shaper.response, gen.outputs)))
        return web.Response(body=body, content_type="application/json")
    finally:
        gen.abort()  # a no-op unless the client went away or something failed


def finish_reason(out: RequestOutput) -> str:
    """"stop" or "length"; an abort is the answer's error."""
    reason = out.finish_reason
    if isinstance(reason, FinishAbort):
        raise abort_error(reason)
    assert reason is not None, "the output is not finished"
    return reason.type


class Shaper:
    """What both routes share: ids, usage, and the streaming loop."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, inp: OpenAIInput, model: str, texts: TokenTexts) -> None:
        self.inp, self.model, self.texts = inp, model, texts
        self.created = int(time.time())

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        completion = 0 if self.inp.hide_output else sum(len(o.ids) for o in outputs)
        # prompt tokens served by the prefix cache, each prompt counted once
        # (its n samples share it), as prompt_tokens counts them
        cached: dict[int, int] = {}
        for o in outputs:
            key = id(o.spec.req.input_ids)
            cached[key] = max(cached.get(key, 0), o.state.cached_tokens)
        return {"prompt_tokens": self.inp.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.inp.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.inp.request_id, "object": object_name, "created": self.created,
                "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [self.choice(k, o) for k, o in enumerate(outputs)]
        return {**self._envelope(self.object_name), "choices": choices, "usage": self.usage(outputs)}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object_name), "choices": choices}
        if self.inp.include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI does
        return chunk

    def encoded(self, build: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """`build(*args)` (a response or a chunk) with its choices' logprob lists
        encoded a chunk at a time: on a worker thread the GIL is let go between
        chunks, where encoding the whole answer at once would hold it."""
        obj = build(*args)
        for choice in obj["choices"]:
            if choice.get("logprobs"):
                choice["logprobs"] = {key: encoded_list(v) if isinstance(v, list) else v
                                      for key, v in choice["logprobs"].items()}
        return obj

    def chunk_entries(self, k: int, lp_start: int, lp_end: int) -> int:
        """Logprob entries a chunk of choice k carries."""
        return (lp_end - lp_start) * (1 + self.inp.top_logprobs) if self.inp.logprobs else 0

    async def chunks(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        n = len(gen.outputs)
        sent_text, sent_lp = [0] * n, [0] * n
        for first in self.opening_chunks(n):
            yield first
        async for changed in gen.updates():
            for k in changed:
                out = gen.outputs[k]
                delta = out.text_since(sent_text[k])
                lp_end = out.text_ids_len() if self.inp.logprobs else 0
                reason = finish_reason(out) if out.done else None  # raises for an abort
                if not delta and lp_end == sent_lp[k] and reason is None:
                    continue  # text held back (a split character or a possible stop string)
                args = (k, out, delta, sent_lp[k], lp_end, reason)
                if not too_large_for_the_loop(self.chunk_entries(k, sent_lp[k], lp_end)):
                    chunk = self.delta_chunk(*args)
                else:  # built off the event loop (an echoed long prompt's logprobs)
                    chunk = await loop.run_in_executor(worker_pool(), self.encoded, self.delta_chunk, *args)
                sent_text[k], sent_lp[k] = out.text_len, lp_end
                if chunk is not None:  # None: the text is held back (a tool call's start, undecided)
                    yield chunk
        if self.inp.include_usage:
            yield self.chunk([], usage=self.usage(gen.outputs))

    def delta_chunk(self, k: int, out: RequestOutput, delta: str, lp_start: int, lp_end: int,
                    reason: str | None) -> dict[str, Any] | None:
        choice = self.delta_choice(k, out, delta, lp_start, lp_end, reason)
        return None if choice is None else self.chunk([choice])

    # route-specific
    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, k: int, out: RequestOutput, delta: str, lp_start: int, lp_end: int,
                     reason: str | None) -> dict[str, Any] | None:
        raise NotImplementedError


def _matched_stop(out: RequestOutput) -> Any:
    """SGLang's extra: the stop string or token id that ended the choice."""
    return matched(out.finish_reason)


class CompletionShaper(Shaper):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, inp: OpenAIInput, model: str, texts: TokenTexts) -> None:
        super().__init__(inp, model, texts)
        self.offsets: dict[int, int] = {}  # per choice: text length of tokens already sent (text_offset)
        self.echoed: set[int] = set()  # streaming echo: the choices whose prompt has been sent

    def _logprobs(self, k: int, out: RequestOutput, start: int, end: int) -> dict[str, Any] | None:
        if not self.inp.logprobs:
            return None
        lp = completion_logprobs(out.ids[start:end], out.token_logprobs[start:end], out.top_logprobs[start:end],
                                 self.texts, self.inp.top_logprobs, self.offsets.get(k, 0))
        if lp["tokens"]:
            self.offsets[k] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def chunk_entries(self, k: int, lp_start: int, lp_end: int) -> int:
        entries = super().chunk_entries(k, lp_start, lp_end)
        if self.inp.echo and self.inp.logprobs and k not in self.echoed:  # the prompt's logprobs come first
            entries += len(self.inp.specs[k].req.input_ids) * (1 + self.inp.top_logprobs)
        return entries

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        if self.inp.echo:
            return self._echo_choice(k, out)
        return {"index": k, "text": out.text, "logprobs": self._logprobs(k, out, 0, out.text_ids_len()),
                "finish_reason": finish_reason(out), "matched_stop": _matched_stop(out)}

    def _echo_choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        """The prompt, then the completion (none with max_tokens 0); with
        logprobs, the prompt's tokens first, the first with null logprob and
        top_logprobs (nothing predicts it), as lm-eval's log-likelihood reads them."""
        reason = finish_reason(out)  # raises for an abort
        end = 0 if self.inp.hide_output else out.text_ids_len()
        self.offsets[k] = len(self.inp.echo_texts[k])  # the completion's text offsets follow the prompt
        choice = self._with_echo(k, out, {"index": k, "text": "" if self.inp.hide_output else out.text,
                                          "logprobs": self._logprobs(k, out, 0, end)})
        return {**choice, "finish_reason": "length" if self.inp.hide_output else reason,
                "matched_stop": None if self.inp.hide_output else _matched_stop(out)}

    def _with_echo(self, k: int, out: RequestOutput, choice: dict[str, Any]) -> dict[str, Any]:
        """`choice` (text and logprobs from the first output token on) with
        the prompt in front. Call before the choice's logprobs are computed:
        their text offsets start after the prompt."""
        prompt = self.inp.echo_texts[k]
        logprobs = None
        if self.inp.logprobs:
            st = out.state
            tops = st.input_top_logprobs if self.inp.top_logprobs else [None] + [[]] * (len(out.spec.req.input_ids) - 1)
            logprobs = completion_logprobs(out.spec.req.input_ids, st.input_token_logprobs, tops, self.texts,
                                           self.inp.top_logprobs, 0)
            for key in logprobs:
                logprobs[key] += choice["logprobs"][key]
        return {**choice, "text": prompt + choice["text"], "logprobs": logprobs}

    def delta_choice(self, k: int, out: RequestOutput, delta: str, lp_start: int, lp_end: int,
                     reason: str | None) -> dict[str, Any]:
        echo_now = self.inp.echo and k not in self.echoed  # the choice's first chunk: the prompt first
        if echo_now:
            self.echoed.add(k)
            self.offsets[k] = len(self.inp.echo_texts[k])
        if self.inp.hide_output:  # max_tokens 0: the prompt alone, its one generated token unshown
            delta, lp_end, reason = "", lp_start, "length" if reason is not None else None
        choice = {"index": k, "text": delta, "logprobs": self._logprobs(k, out, lp_start, lp_end),
                  "finish_reason": reason}
        if echo_now:
            choice = self._with_echo(k, out, choice)
        if reason is not None:
            choice["matched_stop"] = None if self.inp.hide_output else _matched_stop(out)
        return choice


class ChatShaper(Shaper):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, inp: OpenAIInput, model: str, texts: TokenTexts,
                 reasoning: ReasoningParser | None = None) -> None:
        super().__init__(inp, model, texts)
        self.reasoning = reasoning  # None: the text is all content
        self.splitters: dict[int, ReasoningSplitter] = {}  # per streamed choice
        self.streamed: dict[int, StreamedCalls] = {}  # with tools: per streamed choice, its calls so far

    def _splitter(self, k: int) -> ReasoningSplitter:
        assert self.reasoning is not None
        if k not in self.splitters:
            self.splitters[k] = ReasoningSplitter.for_prompt(self.reasoning, self.inp.specs[k].req.input_ids,
                                                             self.texts.tokenizer)
        return self.splitters[k]

    def split_whole(self, k: int, text: str) -> Split:
        """Choice k's whole text as reasoning and content (all content without a parser)."""
        return self._splitter(k).whole(text) if self.reasoning is not None else Split(content=text)

    def split_delta(self, k: int, delta: str, done: bool) -> Split:
        """Choice k's new text as reasoning and content; `done`: its last."""
        if self.reasoning is None:
            return Split(content=delta)
        split = self._splitter(k).feed(delta)
        if done:
            split += self._splitter(k).flush()
        return split

    def _logprobs(self, out: RequestOutput, start: int, end: int) -> dict[str, Any] | None:
        if not self.inp.logprobs:
            return None
        return chat_logprobs(out.ids[start:end], out.token_logprobs[start:end], out.top_logprobs[start:end],
                             self.texts, self.inp.top_logprobs)

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        # OpenAI opens each choice with the role and empty content.
        # (with tools null content, as the whole answer's is when there is none)
        content = None if self.inp.tools is not None else ""
        return [self.chunk([{"index": k, "delta": {"role": "assistant", "content": content},
                             "logprobs": None, "finish_reason": None}]) for k in range(n)]

    def choice(self, k: int, out: RequestOutput) -> dict[str, Any]:
        reason = finish_reason(out)
        split = self.split_whole(k, out.text)
        message: dict[str, Any] = {"role": "assistant", "content": split.content}
        if self.inp.tools is not None:  # calls are read from the content (after any reasoning)
            message, reason = tool_message(self.inp.tools, split.content, reason)
        if self.reasoning is not None:
            message["reasoning_content"] = split.reasoning or None
        return {"index": k, "message": message,
                "logprobs": self._logprobs(out, 0, out.text_ids_len()),
                "finish_reason": reason, "matched_stop": _matched_stop(out)}

    def delta_choice(self, k: int, out: RequestOutput, delta: str, lp_start: int, lp_end: int,
                     reason: str | None) -> dict[str, Any] | None:
        split = self.split_delta(k, delta, done=reason is not None)
        logprobs = self._logprobs(out, lp_start, lp_end)
        if self.inp.tools is None:
            fields = {key: v for key, v in (("reasoning_content", split.reasoning), ("content", split.content)) if v}
        else:
            calls = self.streamed.setdefault(k, StreamedCalls(self.inp.tools))
            fields = {"reasoning_content": split.reasoning} if split.reasoning else {}
            fields.update(calls.delta(split.content, done=reason is not None))
            if reason is not None:
                reason = finish_reason_with_calls(reason, calls.parsed)
            elif not fields and logprobs is None:
                return None  # held back: a tool call's start, undecided
        choice = {"index": k, "delta": fields, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = _matched_stop(out)
        return choice
