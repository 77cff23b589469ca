"""The scheduler process: `python -m scheduler_proc` (started by launch.py).

SIGTERM (from launch.py, or from Linux when launch.py dies) ends it at once:
the tokenizer process has already answered every client by then. A peer
watch ends it too when the model or tokenizer process dies, even while the
loop is blocked waiting for a model step that will never come.
"""

from __future__ import annotations

import logging
import os

import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import ReadyMsg, ToSchedulerMsg
from common.peer_watch import PeerWatch, exit_when_lost
from common.proc import child_main_setup
from scheduler_proc.model_client import ZmqModelClient
from scheduler_proc.create import create_scheduler

logger = logging.getLogger("scheduler")

IDLE_POLL_MS = 1000  # how long an idle loop blocks on its input before looking again


def main() -> None:
    cfg = child_main_setup("scheduler")
    assert cfg.model_info is not None, "the scheduler needs the model process's ModelInfo"
    exit_when_lost(PeerWatch(cfg.ipc, "scheduler"), logger)
    ctx = zmq.Context()
    requests: PullSocket[ToSchedulerMsg] = PullSocket(ctx, cfg.ipc.scheduler_input, ToSchedulerMsg)
    to_tokenizer = PushSocket(ctx, cfg.ipc.tokenizer_input)
    scheduler = create_scheduler(cfg.server_args, cfg.model_info, ZmqModelClient(ctx, cfg.ipc),
                                 to_tokenizer.send)

    def recv_requests(timeout_s: float | None) -> list[ToSchedulerMsg]:
        if timeout_s is None or timeout_s > 0:
            wait_ms = IDLE_POLL_MS if timeout_s is None else max(1, int(timeout_s * 1000))
            first = requests.recv(timeout_ms=wait_ms)
            return ([first] if first is not None else []) + requests.recv_nowait()
        return requests.recv_nowait()

    # kept open: a socket closed at once (LINGER 0) may drop its unsent message
    to_launcher = PushSocket(ctx, cfg.ipc.launcher)
    to_launcher.send(ReadyMsg(proc="scheduler", pid=os.getpid()))
    logger.info("scheduler ready: max_running_requests=%d, max_total_tokens=%d",
                cfg.server_args.max_running_requests, cfg.model_info.max_total_tokens)
    scheduler.event_loop(recv_requests)


if __name__ == "__main__":
    main()
