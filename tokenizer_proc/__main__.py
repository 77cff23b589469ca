"""Entry point of the tokenizer/HTTP process: `python -m tokenizer_proc`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvloop
import zmq

from common.ipc import PushSocket
from common.messages import ReadyMsg
from common.proc import ChildConfig, child_main_setup
from tokenizer_proc.http_server import build_app, start_http
from tokenizer_proc.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("tokenizer_proc")


async def serve(cfg: ChildConfig, tokenizer: Tokenizer) -> None:
    assert cfg.model_info is not None
    args = cfg.server_args
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    app = build_app(args, cfg.model_info, cfg.ipc, tokenizer)
    runner = await start_http(app, args.host, args.port)
    logger.info("HTTP server listening on http://%s:%d", args.host, args.port)

    # Ready only once the port accepts connections. The socket stays open until
    # exit: closing it at once (LINGER 0) could drop the unsent message.
    ctx = zmq.Context()
    to_launcher = PushSocket(ctx, cfg.ipc.launcher)
    to_launcher.send(ReadyMsg(proc="tokenizer", pid=os.getpid()))
    try:
        await stop.wait()
        logger.info("SIGTERM: shutting down")
    finally:
        await runner.cleanup()
        to_launcher.close()
        ctx.term()


def main() -> None:
    cfg = child_main_setup("tokenizer")
    if cfg.model_info is None:
        raise SystemExit("tokenizer_proc needs model_info in its config")
    tokenizer = load_tokenizer(cfg.model_info.tokenizer_path)
    uvloop.run(serve(cfg, tokenizer))


if __name__ == "__main__":
    main()
