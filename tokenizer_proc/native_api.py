"""SGLang's native `POST /generate`.

Answer: `{"text", "output_ids", "meta_info"}` per output, or a JSON list of
them for a list of prompts or n > 1 (prompt-major order). Streaming sends the
cumulative text in every event, as SGLang does; for a list or n > 1 the
outputs' events interleave, each with its `index` in that order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from tokenizer_proc.app_keys import MANAGER, MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.errors import json_response
from tokenizer_proc.generation import Generation, worker_pool
from tokenizer_proc.grammar import check_grammars
from tokenizer_proc.logprobs import (TokenTexts, large_answer, native_ids_logprobs, native_token_logprobs,
                                     native_top_logprobs)
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.protocol import GenerateInput, check_generate_request
from tokenizer_proc.request_output import RequestOutput
from tokenizer_proc.sse import stream_events
from tokenizer_proc.validation import parse_json_object


async def generate(request: web.Request) -> web.StreamResponse:
    tokenizer, info = request.app[TOKENIZER], request.app[MODEL_INFO]
    arrival = time.perf_counter()  # e2e latency includes reading and tokenizing
    body = parse_json_object(await read_body(request))
    pending = check_generate_request(body, info.context_len, info.vocab_size, request.app[PROMPT_CHAR_LIMIT])
    inp = pending.finish(await request.app[TOKENIZER_POOL].run(pending.encode, tokenizer))
    await check_grammars([spec.req.sampling_params.grammar for spec in inp.specs],
                         request.app[SERVER_ARGS])
    gen = Generation(request.app[MANAGER], tokenizer, inp.specs, inp.stream, arrival,
                     request.app[SERVER_ARGS].max_logprob_entries)
    gen.submit()
    try:
        texts = TokenTexts(tokenizer) if inp.return_text_in_logprobs else None
        if inp.stream:
            await gen.admitted()
            incremental = request.app[SERVER_ARGS].incremental_streaming_output
            return await stream_events(request, _events(gen, inp, texts, incremental), gen.outputs[0].rid)
        await gen.wait()
        gen.raise_refusal()  # refused at admission: queue full (503) or cannot run (400)
        if not large_answer(gen.outputs):
            outs = [output_json(o, inp, texts) for o in gen.outputs]
            return json_response(outs if inp.batched else outs[0])
        body = await asyncio.get_running_loop().run_in_executor(worker_pool(), _encode_answer, gen, inp, texts)
        return web.Response(body=body, content_type="application/json")
    finally:
        gen.abort()  # a no-op unless the client went away or something failed


async def _events(gen: Generation, inp: GenerateInput, texts: TokenTexts | None,
                  incremental: bool = False) -> AsyncIterator[Any]:
    """incremental (--incremental-streaming-output): each event has only the
    text, output_ids and output logprobs new since that output's last event."""
    loop = asyncio.get_running_loop()
    sent: dict[int, tuple[int, int]] = {}  # output -> (text characters, ids) already sent

    async def event(k: int) -> dict[str, Any]:
        out = gen.outputs[k]
        since = sent.get(k, (0, 0)) if incremental else (0, 0)
        sent[k] = (out.text_len, len(out.ids))
        if large_answer([out]):  # built on a worker thread, its logprobs already encoded
            return await loop.run_in_executor(worker_pool(), output_json, out, inp, texts, since, True)
        return output_json(out, inp, texts, since)

    async for changed in gen.updates():
        for k in [0] if not inp.batched else changed:
            ev = await event(k)
            yield ev if not inp.batched else {**ev, "index": k}


def _encode_answer(gen: Generation, inp: GenerateInput, texts: TokenTexts | None) -> bytes:
    outs = [output_json(o, inp, texts, chunked=True) for o in gen.outputs]
    return msgspec.json.encode(outs if inp.batched else outs[0])


def output_json(out: RequestOutput, inp: GenerateInput, texts: TokenTexts | None,
                since: tuple[int, int] = (0, 0), chunked: bool = False) -> dict[str, Any]:
    """`since`: (text characters, output ids) to leave out, already streamed;
    `chunked`: the logprob lists come already encoded, a chunk at a time (on
    a worker thread, so the GIL is let go between chunks)."""
    text_from, ids_from = since
    meta = out.meta_info()
    if out.spec.req.return_logprob:
        meta["output_token_logprobs"] = native_token_logprobs(out.ids[ids_from:], out.token_logprobs[ids_from:],
                                                              texts, chunked)
        # SGLang's: how many output_token_logprobs the request has so far (its
        # frontend checks it against completion_tokens while streaming)
        meta["output_token_logprobs_length"] = len(out.token_logprobs)
        meta["output_top_logprobs"] = native_top_logprobs(out.top_logprobs[ids_from:], texts, chunked)
        start = out.spec.req.logprob_start_len
        if start >= 0:  # prompt logprobs: the prompt tokens from `start`, the first null
            meta.update(out.encoded_input_logprobs if chunked and out.encoded_input_logprobs
                        else _input_logprobs(out, start, texts, chunked))
        wanted = out.spec.req.token_ids_logprob
        if wanted:  # SGLang's layout: per position [[logprob, id, text], ...] in the ids' order
            meta["output_token_ids_logprobs"] = native_ids_logprobs(wanted, out.token_ids_logprobs[ids_from:], texts)
            meta["input_token_ids_logprobs"] = native_ids_logprobs(wanted, out.state.input_token_ids_logprobs,
                                                                   texts)
    text = out.text_since(text_from) if text_from else out.text
    return {"text": text, "output_ids": out.ids[ids_from:], "meta_info": meta}


def _input_logprobs(out: RequestOutput, start: int, texts: TokenTexts | None, chunked: bool) -> dict[str, Any]:
    """The prompt's logprobs; once they have arrived, encoded ones are kept:
    every streamed event repeats them, unchanged."""
    fields: dict[str, Any] = {"input_token_logprobs": native_token_logprobs(
        out.spec.req.input_ids[start:], out.state.input_token_logprobs, texts, chunked)}
    if out.spec.req.top_logprobs_num > 0:
        fields["input_top_logprobs"] = native_top_logprobs(out.state.input_top_logprobs, texts, chunked)
    if chunked and out.state.input_token_logprobs:
        out.encoded_input_logprobs = fields
    return fields
