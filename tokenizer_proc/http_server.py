"""The HTTP front end (aiohttp): the app, its middlewares and its routes.

Routes live in their API's module: `native_api` (SGLang's `/generate`),
`openai_api` (`/v1/completions`, `/v1/chat/completions`, `/v1/models`),
`responses_api` (`/v1/responses`), `anthropic_api` (`/v1/messages`),
`tokenize_api`, `score_api` (`/v1/score`) and `ops_api` (health, info, aborts). Each request is
checked in its handler (everything that needs no tokens first, prompt
lengths included), tokenized on the tokenizer pool's threads (never on the
event loop), checked again against the context, sent to the scheduler, and
the handler then sleeps until output arrives. A handler that ends early for
any reason (client gone: aiohttp cancels it; an error) aborts its requests in
`finally`, so the scheduler frees their KV at once.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import AsyncIterator

from aiohttp import web

from common.messages import IpcPaths, ModelInfo
from common.server_args import ServerArgs
from tokenizer_proc import (anthropic_api, native_api, openai_api, ops_api, responses_api, score_api,
                            tokenize_api)
from tokenizer_proc.app_keys import (HEALTH_GENERATE_TIMEOUT, MANAGER, MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS,
                                     TOKENIZER, TOKENIZER_POOL)
from tokenizer_proc.connections import ConnectionGate, GatedSite, connection_limit
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.middlewares import (ADMIN_KEY, API_KEY, BODY_TIMEOUT, GATE, HOST_RULE, MAX_BODY, HostRule,
                                        error_middleware, expect_handler, gate_middleware)
from tokenizer_proc.response_store import ResponseStore
from tokenizer_proc.tokenizer import Tokenizer, TokenizerPool
from tokenizer_proc.validation import prompt_char_limit

__all__ = ["MANAGER", "build_app", "start_http"]

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_GENERATE_TIMEOUT = 20.0  # seconds


def build_app(
    server_args: ServerArgs, model_info: ModelInfo, ipc: IpcPaths, tokenizer: Tokenizer,
    health_generate_timeout: float = DEFAULT_HEALTH_GENERATE_TIMEOUT,
) -> web.Application:
    """The app, ready to run; its startup hook binds the ZMQ sockets."""
    # The error middleware is outermost so the gate's errors get the error shape.
    # client_max_size backs up our own cap (`read_body`) for any handler that
    # would call request.read() itself.
    app = web.Application(middlewares=[error_middleware, gate_middleware],
                          client_max_size=server_args.max_request_bytes)
    app[API_KEY] = server_args.api_key
    app[ADMIN_KEY] = server_args.admin_api_key
    app[HOST_RULE] = HostRule(server_args.host, server_args.allowed_hosts)
    app[BODY_TIMEOUT] = server_args.body_timeout_s
    app[GATE] = ConnectionGate(connection_limit(server_args.max_connections,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
    app[TOKENIZER] = tokenizer
    app[TOKENIZER_POOL] = TokenizerPool()  # threads start on first use
    app[PROMPT_CHAR_LIMIT] = prompt_char_limit(model_info.context_len, getattr(tokenizer, "max_token_chars", None))
    app[MODEL_INFO] = model_info
    app[SERVER_ARGS] = server_args
    app[MAX_BODY] = server_args.max_request_bytes
    app[HEALTH_GENERATE_TIMEOUT] = health_generate_timeout
    app[ops_api.SCHEDULER_STATE] = ops_api.scheduler_state_getter(app)
    app[responses_api.STORE] = ResponseStore()  # the Responses API's store: true responses

    async def scheduler_link(app: web.Application) -> AsyncIterator[None]:
        manager = TokenizerManager(ipc, server_args)
        manager.start()
        app[MANAGER] = manager
        yield
        app[TOKENIZER_POOL].close()
        await manager.close()

    async def finish_in_flight(app: web.Application) -> None:
        app[MANAGER].finish_all("the server is shutting down")

    app.cleanup_ctx.append(scheduler_link)
    app.on_shutdown.append(finish_in_flight)  # runs before waiting for handlers

    r = app.router
    for path, handler in (("/generate", native_api.generate),
                          ("/v1/completions", openai_api.completions),
                          ("/v1/chat/completions", openai_api.chat_completions),
                          ("/abort_request", ops_api.abort_request),
                          ("/tokenize", tokenize_api.tokenize), ("/v1/tokenize", tokenize_api.tokenize),
                          ("/detokenize", tokenize_api.detokenize), ("/v1/detokenize", tokenize_api.detokenize),
                          ("/v1/messages", anthropic_api.messages),
                          ("/v1/messages/count_tokens", anthropic_api.count_tokens),
                          ("/v1/responses", responses_api.create), ("/v1/score", score_api.score)):
        r.add_post(path, handler, expect_handler=expect_handler)
    r.add_get("/v1/responses/{response_id}", responses_api.retrieve)
    r.add_get("/v1/models", openai_api.list_models)
    # Hugging Face ids have a slash (org/model): the name is the rest of the path
    r.add_get("/v1/models/{model:.+}", openai_api.retrieve_model)
    r.add_get("/health", ops_api.health)
    r.add_get("/health_generate", ops_api.health_generate)
    r.add_get("/get_model_info", ops_api.get_model_info)
    r.add_get("/get_server_info", ops_api.get_server_info)
    r.add_get("/model_info", ops_api.get_model_info)  # SGLang's newer names (sglang-router asks these first)
    r.add_get("/server_info", ops_api.get_server_info)
    r.add_get("/get_load", ops_api.get_load)
    r.add_route("*", "/flush_cache", ops_api.flush_cache)  # SGLang takes GET and POST
    r.add_get("/timeline", ops_api.timeline)
    r.add_get("/dashboard", ops_api.dashboard)
    if server_args.enable_metrics:
        r.add_get("/metrics", ops_api.metrics)
    return app


async def start_http(
    app: web.Application, host: str, port: int, shutdown_timeout: float = 2.0
) -> web.AppRunner:
    """Starts serving; returns the runner (call `cleanup()` to stop).

    handler_cancellation: aiohttp then cancels a handler whose client
    disconnected, which is how a waiting non-streaming request learns to abort.
    shutdown_timeout: how long `cleanup()` lets in-flight requests run on. Short,
    because at shutdown the scheduler is stopping too and will not finish them.
    keepalive_timeout: aiohttp closes a connection still waiting for a whole
    request head when it fires (from the connection's start, or its last
    response), so it is the header timeout (tokenizer_proc/connections.py).
    lingering_time: how long an unread body is drained after a refusal.
    """
    args = app[SERVER_ARGS]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=args.header_timeout_s,
                           lingering_time=min(args.body_timeout_s, 10.0))
    await runner.setup()
    await GatedSite(runner, host, port, app[GATE]).start()
    return runner
