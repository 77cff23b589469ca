"""Operations routes: health, model and server info, aborting requests."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from common.messages import FinishAbort, FlushCacheQuery, SamplingParams, StateQuery, TimelineQuery, TokenizedGenerateReq
from tokenizer_proc.app_keys import HEALTH_GENERATE_TIMEOUT, MANAGER, MODEL_INFO, SERVER_ARGS, TOKENIZER
from tokenizer_proc.errors import BadRequestError, ServiceUnavailableError, json_response
from tokenizer_proc.generation import Generation
from tokenizer_proc.middlewares import read_body, require_admin
from tokenizer_proc.request_spec import RequestSpec
from tokenizer_proc.validation import check_bool, is_decimal, parse_json_object

logger = logging.getLogger(__name__)

# The scheduler's live state (queue lengths, KV usage, counters): a coroutine
# function returning a dict, or None when the scheduler does not answer in time.
SCHEDULER_STATE = web.AppKey("scheduler_state", Callable[[], Awaitable[dict[str, Any] | None]])
SCHEDULER_QUERY_TIMEOUT = 5.0  # seconds


def scheduler_state_getter(app: web.Application) -> Callable[[], Awaitable[dict[str, Any] | None]]:
    async def get() -> dict[str, Any] | None:
        try:
            reply = await app[MANAGER].query_scheduler(StateQuery, SCHEDULER_QUERY_TIMEOUT)
        except asyncio.TimeoutError:
            return None
        return reply.data
    return get


async def health(request: web.Request) -> web.Response:
    """200 while the engine answers: the scheduler's heartbeats arrive, and the
    model answers its steps, within --health-check-timeout; else 503 naming
    which is silent (no engine round trip: cheap enough for probes)."""
    reason = request.app[MANAGER].unresponsive()
    if reason is not None:
        raise ServiceUnavailableError(reason)
    return json_response({})


async def health_generate(request: web.Request) -> web.Response:
    """One one-token request through the whole engine; 503 when it does not
    finish within the timeout (the scheduler or model is stuck or gone)."""
    timeout = request.app[HEALTH_GENERATE_TIMEOUT]
    spec = RequestSpec(TokenizedGenerateReq(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                                            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)))
    gen = Generation(request.app[MANAGER], request.app[TOKENIZER], [spec], False, time.perf_counter())
    gen.submit()
    try:
        await asyncio.wait_for(gen.wait(), timeout)
    except asyncio.TimeoutError:
        gen.abort()
        gen.forget()  # a stuck scheduler may never send the final row
        raise ServiceUnavailableError(f"the engine did not answer within {timeout:g} s") from None
    finally:
        gen.abort()
    reason = gen.outputs[0].finish_reason
    if isinstance(reason, FinishAbort):
        raise ServiceUnavailableError(f"the health check request was aborted: {reason.message}")
    return json_response({})


async def get_model_info(request: web.Request) -> web.Response:
    info = msgspec.structs.asdict(request.app[MODEL_INFO])
    return json_response({**info, "is_generation": True})


async def get_server_info(request: web.Request) -> web.Response:
    args = dataclasses.asdict(request.app[SERVER_ARGS])
    for secret in ("api_key", "admin_api_key"):
        if args.get(secret):
            args[secret] = "<set>"  # never echo the secret
    return json_response({
        **args,
        "model_info": msgspec.structs.asdict(request.app[MODEL_INFO]),
        "requests_in_flight": len(request.app[MANAGER].states),
        "scheduler": await request.app[SCHEDULER_STATE](),
    })


async def get_load(request: web.Request) -> web.Response:
    """SGLang's load report, one entry per data-parallel rank (here one): what
    sglang-router's load-aware policies read from each worker."""
    state = await request.app[SCHEDULER_STATE]()
    if state is None:
        raise ServiceUnavailableError("the scheduler did not answer")
    waiting = state["num_waiting_reqs"] + state.get("num_grammar_queue_reqs", 0)
    return json_response([{"dp_rank": 0, "num_reqs": state["num_running_reqs"] + waiting,
                           "num_waiting_reqs": waiting, "num_tokens": state["held_kv_slots"]}])


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's cache flush: empties the prefix cache and resets the
    scheduler's admission estimate; like SGLang, it is refused (400) while
    requests run or wait."""
    try:
        reply = await request.app[MANAGER].query_scheduler(FlushCacheQuery, SCHEDULER_QUERY_TIMEOUT)
    except asyncio.TimeoutError:
        raise ServiceUnavailableError("the scheduler did not answer") from None
    if not reply.ok:
        raise BadRequestError(reply.message)
    return web.Response(text=reply.message + "\n")


DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"


async def timeline(request: web.Request) -> web.Response:
    """The scheduler's recent events, oldest first: newer than ?since=<unix
    time> and after ?after_seq=<n> (defaults: all kept), at most ?limit=<n>
    (and the scheduler's bound) a call; `more` says a next call, from
    `next_seq`, has more."""
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise BadRequestError("since must be a number (seconds since the epoch)") from None
    if not math.isfinite(since):
        raise BadRequestError("since must be finite")
    cursor = {}
    for name in ("after_seq", "limit"):
        raw = request.query.get(name, "0")
        if not is_decimal(raw, 12):
            raise BadRequestError(f"{name} must be a non-negative integer (ASCII digits)")
        cursor[name] = int(raw)
    try:
        reply = await request.app[MANAGER].query_scheduler(TimelineQuery, SCHEDULER_QUERY_TIMEOUT,
                                                           since=since, **cursor)
    except asyncio.TimeoutError:
        raise ServiceUnavailableError("the scheduler did not answer") from None
    return json_response(reply.data)


async def dashboard(request: web.Request) -> web.Response:
    """A self-contained page (no build step, no network fetch) that polls /timeline."""
    return web.Response(text=DASHBOARD_HTML.read_text(), content_type="text/html")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format (only routed with --enable-metrics)."""
    text = request.app[MANAGER].metrics.render(await request.app[SCHEDULER_STATE]())
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def abort_request(request: web.Request) -> web.Response:
    """{"rid": id} aborts that request (or every request of a fanned-out one);
    {"abort_all": true} aborts everything. An unknown rid is not an error: the
    request may just have finished."""
    body = parse_json_object(await read_body(request))
    manager = request.app[MANAGER]
    if body.get("abort_all") is not None and check_bool("abort_all", body["abort_all"]):
        require_admin(request, "abort_all")
        aborted = manager.abort_all()
    elif isinstance(body.get("rid"), str) and body["rid"]:
        aborted = manager.abort_rid(body["rid"])
    else:
        raise BadRequestError('give {"rid": "<request id>"} or {"abort_all": true}')
    logger.info("/abort_request aborted %d request(s)", len(aborted))
    return json_response({"aborted": aborted})
