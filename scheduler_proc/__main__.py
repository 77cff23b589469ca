"""The scheduler process: `python -m scheduler_proc` (started by launch.py).

SIGTERM (from launch.py, or from Linux when launch.py dies) ends it at once:
the tokenizer process has already answered every client by then. A peer
watch ends it too when the model or tokenizer process dies, even while the
loop is blocked waiting for a model step that will never come; and the
watchdog (--watchdog-timeout) when the model is alive but does not answer:
exit 1, as on a crash, after telling the front end why (it fails every
request with that reason and launch.py takes the server down).
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import ReadyMsg, SchedulerHeartbeat, ToSchedulerMsg
from common.peer_watch import PeerWatch, exit_when_lost
from common.proc import child_main_setup, freeze_startup_heap, wait_model_info
from scheduler_proc.model_client import ZmqModelClient
from scheduler_proc.create import create_scheduler
from scheduler_proc.watchdog import HEARTBEAT_S, WatchdogTimeout

logger = logging.getLogger("scheduler")

IDLE_POLL_MS = int(HEARTBEAT_S * 1000)  # an idle loop looks again this often (and sends its heartbeat)
# the watchdog's last message leaves, and the front end reads it (its watch looks
# every 0.25 s), before this process is seen gone
LAST_WORD_S = 0.5


def main() -> None:
    cfg = child_main_setup("scheduler")
    model_info = wait_model_info(cfg)
    exit_when_lost(PeerWatch(cfg.ipc, "scheduler"), logger)
    ctx = zmq.Context()
    requests: PullSocket[ToSchedulerMsg] = PullSocket(ctx, cfg.ipc.scheduler_input, ToSchedulerMsg)
    to_tokenizer = PushSocket(ctx, cfg.ipc.tokenizer_input)
    model = ZmqModelClient(ctx, cfg.ipc, wait_poll_s=HEARTBEAT_S)
    scheduler = create_scheduler(cfg.server_args, model_info, model, to_tokenizer.send)
    model.on_wait = scheduler.tick

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
                cfg.server_args.max_running_requests, model_info.max_total_tokens)
    freeze_startup_heap()
    try:
        scheduler.event_loop(recv_requests)
    except WatchdogTimeout as e:
        logger.error("watchdog: %s; exiting, as on a crash, so the server stops and can be restarted", e)
        try:
            to_tokenizer.send(SchedulerHeartbeat(watchdog_error=f"watchdog: {e}"), block=False)
            time.sleep(LAST_WORD_S)
        except zmq.ZMQError:
            pass  # the front end is not reading: launch.py tells it when we are gone
        os._exit(1)  # not sys.exit: a socket to the stuck model would keep the context from closing


if __name__ == "__main__":
    main()
