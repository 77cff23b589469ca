"""The model process: receive a ForwardBatch, run it, send a ForwardResult.

Started by launch.py as `python -m model_proc`. SIGTERM ends it at once; a
peer watch ends it when the scheduler or tokenizer process dies (the loop
would otherwise wait forever for the next batch).
"""

from __future__ import annotations

import logging
import os

import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import ForwardBatch, ReadyMsg
from common.peer_watch import PeerWatch, exit_when_lost
from common.proc import child_main_setup
from model_proc.runner import ModelRunner

logger = logging.getLogger("model_proc")


def main() -> None:
    cfg = child_main_setup("model")
    exit_when_lost(PeerWatch(cfg.ipc, "model"), logger)  # also while the weights load
    try:
        runner = ModelRunner(cfg.server_args)
        ctx = zmq.Context()
        batches: PullSocket[ForwardBatch] = PullSocket(ctx, cfg.ipc.model_input, ForwardBatch)
        results = PushSocket(ctx, cfg.ipc.model_output)
        launcher = PushSocket(ctx, cfg.ipc.launcher)
        launcher.send(ReadyMsg(proc="model", pid=os.getpid(), model_info=runner.model_info))
        logger.info("Model process ready: %s", runner.model_info)
        while True:
            batch = batches.recv()
            assert batch is not None  # recv without timeout blocks
            results.send(runner.forward(batch))
    except Exception:
        # launch.py notices the death and takes the server down
        logger.exception("model process failed")
        raise


if __name__ == "__main__":
    main()
