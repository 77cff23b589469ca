"""The HTTP front end (aiohttp): SGLang's native `/generate` and `/health`.

Each request is tokenized and validated here, sent to the scheduler, and its
handler then sleeps on its `ReqState` until output arrives. A handler that
ends early for any reason (client gone: aiohttp cancels it; an error) aborts
its request in `finally`, so the scheduler frees its KV at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from common.messages import IpcPaths, ModelInfo, TokenizedGenerateReq
from common.server_args import ServerArgs
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.manager import DuplicateRidError, ReqState, TokenizerManager
from tokenizer_proc.protocol import BadRequestError, GenerateInput, parse_generate_request, parse_json_object
from tokenizer_proc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", TokenizerManager)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
MODEL_INFO = web.AppKey("model_info", ModelInfo)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(message: str, status: int, err_type: str) -> web.Response:
    return json_response({"error": {"message": message, "type": err_type, "code": status}}, status)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Client errors become 400s; anything else is logged and becomes a 500
    for this request alone."""
    try:
        return await handler(request)
    except BadRequestError as e:
        return error_response(str(e), 400, "BadRequestError")
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception("error while handling %s %s", request.method, request.path)
        return error_response(f"internal error: {e}", 500, "InternalServerError")


async def health(request: web.Request) -> web.Response:
    return json_response({})


async def generate(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    tokenizer = request.app[TOKENIZER]
    info = request.app[MODEL_INFO]
    arrival = time.perf_counter()  # e2e latency includes tokenizing
    body = parse_json_object(await request.read())
    inp = parse_generate_request(body, tokenizer, info.context_len, info.vocab_size)
    state = submit(manager, inp, arrival)
    try:
        if inp.stream:
            return await stream_response(request, state, tokenizer, inp)
        while not state.finished:
            await state.event.wait()
            state.event.clear()
        text = tokenizer.decode(state.text_ids(), inp.sampling_params.skip_special_tokens)
        return json_response(output_json(state, text))
    finally:
        # Still running: the client went away (cancelled) or something failed.
        manager.abort(state)


def submit(manager: TokenizerManager, inp: GenerateInput, arrival: float) -> ReqState:
    req = TokenizedGenerateReq(
        rid=inp.rid or uuid.uuid4().hex,
        input_ids=inp.input_ids,
        sampling_params=inp.sampling_params,
        stream=inp.stream,
        arrival_time=time.time(),
    )
    try:
        return manager.submit(req, arrival)
    except DuplicateRidError as e:
        raise BadRequestError(str(e)) from None


def output_json(state: ReqState, text: str) -> dict[str, Any]:
    return {"text": text, "output_ids": list(state.output_ids), "meta_info": state.meta_info()}


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def stream_response(
    request: web.Request, state: ReqState, tokenizer: Tokenizer, inp: GenerateInput
) -> web.StreamResponse:
    """Server-sent events, one per update, each with the cumulative text."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    detok = IncrementalDetokenizer(tokenizer, inp.sampling_params.skip_special_tokens)
    fed = 0
    try:
        while True:
            await state.event.wait()
            state.event.clear()
            done = state.finished
            ids = state.text_ids() if done else state.output_ids
            detok.add(ids[fed:])
            fed = len(ids)
            if done:
                detok.flush()
            await resp.write(sse(output_json(state, detok.text)))
            if done:
                break
    except Exception as e:
        if request.transport is None or request.transport.is_closing():
            logger.info("client of %s went away", state.rid)
            return resp  # nothing to tell it; the caller aborts the request
        # Headers are already sent, so the error goes into the stream.
        logger.exception("error while streaming %s", state.rid)
        await resp.write(sse({"error": {"message": f"internal error: {e}",
                                        "type": "InternalServerError", "code": 500}}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def build_app(
    server_args: ServerArgs, model_info: ModelInfo, ipc: IpcPaths, tokenizer: Tokenizer
) -> web.Application:
    """The app, ready to run; its startup hook binds the ZMQ sockets."""
    app = web.Application(middlewares=[error_middleware])
    app[TOKENIZER] = tokenizer
    app[MODEL_INFO] = model_info

    async def scheduler_link(app: web.Application) -> AsyncIterator[None]:
        manager = TokenizerManager(ipc)
        manager.start()
        app[MANAGER] = manager
        yield
        await manager.close()

    async def finish_in_flight(app: web.Application) -> None:
        app[MANAGER].finish_all("the server is shutting down")

    app.cleanup_ctx.append(scheduler_link)
    app.on_shutdown.append(finish_in_flight)  # runs before waiting for handlers
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    return app


async def start_http(
    app: web.Application, host: str, port: int, shutdown_timeout: float = 2.0
) -> web.AppRunner:
    """Starts serving; returns the runner (call `cleanup()` to stop).

    handler_cancellation: aiohttp then cancels a handler whose client
    disconnected, which is how a waiting non-streaming request learns to abort.
    shutdown_timeout: how long `cleanup()` lets in-flight requests run on. Short,
    because at shutdown the scheduler is stopping too and will not finish them.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
