"""Entry point of the tokenizer/HTTP process: `python -m tokenizer_proc`.

Signals (sent by launch.py): SIGTERM drains (finish what is in flight, up to
--shutdown-timeout); SIGUSR1 means fail everything in flight now (a peer
process died, or a second Ctrl-C), for the reason launch.py left in the
socket folder. The process also watches its peers itself (`common.peer_watch`),
so it fails fast even when launch.py is gone. See `shutdown.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import uvloop
import zmq

from common.ipc import PushSocket
from common.messages import ReadyMsg
from common.peer_watch import PeerWatch, read_stop_reason, socket_dir
from common.proc import ChildConfig, child_main_setup, freeze_startup_heap, wait_model_info
from common.tokenizer_files import import_tokenizer_library
from tokenizer_proc.connections import raise_open_file_limit
from tokenizer_proc.http_server import MANAGER, build_app, start_http
from tokenizer_proc.shutdown import Shutdown
from tokenizer_proc.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("tokenizer_proc")


async def serve(cfg: ChildConfig, tokenizer: Tokenizer) -> int:
    """Runs until stopped; returns the exit code (1 when a peer died)."""
    assert cfg.model_info is not None
    args = cfg.server_args
    app = build_app(args, cfg.model_info, cfg.ipc, tokenizer)
    shutdown = Shutdown(lambda: app.get(MANAGER), args.shutdown_timeout)
    app.middlewares.insert(0, shutdown.middleware())  # outermost; before the app freezes

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, shutdown.drain)
    loop.add_signal_handler(signal.SIGUSR1, lambda: shutdown.fail_fast(
        read_stop_reason(socket_dir(cfg.ipc), "launch.py asked to abort everything")))
    watch = PeerWatch(cfg.ipc, "tokenizer")
    watcher = loop.create_task(shutdown.watch_peers(watch))

    runner = await start_http(app, args.host, args.port)
    logger.info("HTTP server listening on http://%s:%d", args.host, args.port)
    freeze_startup_heap()

    # Ready only once the port accepts connections. The socket stays open until
    # exit: closing it at once (LINGER 0) could drop the unsent message.
    ctx = zmq.Context()
    to_launcher = PushSocket(ctx, cfg.ipc.launcher)
    to_launcher.send(ReadyMsg(proc="tokenizer", pid=os.getpid()))
    try:
        await shutdown.run(runner)
    finally:
        watcher.cancel()
        await runner.cleanup()
        to_launcher.close()
        ctx.term()
        watch.remove_socket_dir_if_orphaned()  # whichever way we got here
    logger.info("stopped")
    return 1 if shutdown.failed is not None else 0


def main() -> None:
    cfg = child_main_setup("tokenizer")
    logger.info("open-file limit %d", raise_open_file_limit())  # every connection is a descriptor
    import_tokenizer_library()  # while the model loads: off the start's critical path
    model_info = wait_model_info(cfg)
    try:
        tokenizer = load_tokenizer(model_info.tokenizer_path, cfg.server_args.chat_template_text())
    except ValueError as e:  # --chat-template refused: one line, not a traceback
        raise SystemExit(f"tokenizer_proc: {e}") from None
    sys.exit(uvloop.run(serve(cfg, tokenizer)))


if __name__ == "__main__":
    main()
