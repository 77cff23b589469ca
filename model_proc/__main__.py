"""The model process: receive a ForwardBatch, run it, send a ForwardResult.

Started by launch.py as `python -m model_proc`, once per tensor-parallel
rank. Rank 0 alone talks to the scheduler over ZMQ and broadcasts each batch
to the other ranks (torch.distributed), which run it in lockstep. SIGTERM
ends it at once; a peer watch ends it when a sibling process dies (the loop
would otherwise wait forever for the next batch), and a rank on another node
that dies breaks the next collective, which ends this one too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from common.cpu_runtime import model_threads
from common.ipc import PullSocket, PushSocket
from common.messages import ForwardBatch, ReadyMsg
from common.peer_watch import PeerWatch, exit_when_lost
from common.proc import ChildConfig, child_main_setup, freeze_startup_heap, model_proc_name, setup_logging
from common.server_args import ServerArgs
from model_proc.parallel import TensorParallel, init_tensor_parallel
from model_proc.quant import weight as quant_weight
from model_proc.runner import ModelRunner

logger = logging.getLogger("model_proc")

# Rank 0 broadcasts an empty message when no batch came for this long: the
# other ranks' wait never reaches the group's timeout, and a dead rank
# elsewhere (another node, beyond the peer watch) breaks the broadcast and
# so ends rank 0, and with it the server, even when the server is idle.
HEARTBEAT_MS = 1000
# What rank 0 broadcasts when launch.py stops it (SIGTERM): the other ranks
# exit 0, so a node that runs only model ranks can tell an orderly stop from
# a crash. No encoded ForwardBatch is one byte long.
STOP = b"\x00"


def rank_device(sa: ServerArgs, rank: int) -> torch.device:
    """One GPU per rank: cuda:<rank on this node>; a CPU rank runs on the CPU."""
    if torch.device(sa.device).type == "cuda":
        return torch.device("cuda", rank % sa.tp_ranks_per_node)
    return torch.device("cpu")


def main() -> None:
    cfg = child_main_setup("model")
    sa, rank = cfg.server_args, cfg.tp_rank
    name = model_proc_name(rank)
    if sa.tp_size > 1:
        setup_logging(sa.log_level, f"model tp{rank}")
    exit_when_lost(PeerWatch(cfg.ipc, name), logger)  # also while the weights load
    try:
        device = rank_device(sa, rank)
        threads = model_threads(sa.cpu_threads, sa.tp_ranks_per_node) if device.type == "cpu" else None
        if threads is not None:
            # a node's ranks share its cores: one OpenMP pool per rank, not one per core each
            torch.set_num_threads(threads)
        tp = init_tensor_parallel(rank, sa.tp_size, sa.dist_init_addr, device)
        # one model a process: the switch is the quant package's (tests flip it in-process)
        quant_weight.use_q8_activations = sa.int8_activations
        try:
            runner = ModelRunner(sa, tp)
        except ValueError as e:  # flags that do not fit the model (e.g. --tp-size): the reason, no traceback
            logger.error("cannot start: %s", e)
            # at once: the interpreter's teardown with a process group spent ~2 s in
            # torch.distributed's before launch.py saw the exit
            os._exit(1)
        ctx = zmq.Context()
        launcher = PushSocket(ctx, cfg.ipc.launcher)
        freeze_startup_heap()
        if tp.is_first:
            serve(cfg, runner, tp, ctx, launcher)
        else:
            launcher.send(ReadyMsg(proc=name, pid=os.getpid()))
            logger.info("Model rank %d of %d ready", rank, sa.tp_size)
            follow(runner, tp)
    except Exception:
        # launch.py notices the death and takes the server down
        logger.exception("model process failed")
        raise


def serve(cfg: ChildConfig, runner: ModelRunner, tp: TensorParallel, ctx: zmq.Context,
          launcher: PushSocket) -> None:
    """Rank 0: batches from the scheduler, results back to it."""
    batches: PullSocket[ForwardBatch] = PullSocket(ctx, cfg.ipc.model_input, ForwardBatch)
    results = PushSocket(ctx, cfg.ipc.model_output)
    launcher.send(ReadyMsg(proc="model", pid=os.getpid(), model_info=runner.model_info))
    logger.info("Model process ready: %s", runner.model_info)
    decoder = msgspec.msgpack.Decoder(ForwardBatch)
    stopping = False
    if tp.size > 1:
        def on_sigterm(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True  # checked between batches (within HEARTBEAT_MS when idle)

        signal.signal(signal.SIGTERM, on_sigterm)
    while True:
        if stopping:
            logger.info("stopping: telling the other ranks")
            tp.broadcast_bytes(STOP)
            return
        if tp.size == 1:
            batch = batches.recv()
            assert batch is not None  # recv without timeout blocks
        else:
            if not batches.sock.poll(HEARTBEAT_MS):
                tp.broadcast_bytes(b"")
                continue
            # the encoded batch as it came, to every rank, before anyone decodes it
            batch = decoder.decode(tp.broadcast_bytes(batches.sock.recv()))
        results.send(runner.forward(batch))


def follow(runner: ModelRunner, tp: TensorParallel) -> None:
    """Ranks 1..N-1: run every batch rank 0 broadcasts, in the same order."""
    decoder = msgspec.msgpack.Decoder(ForwardBatch)
    while True:
        data = tp.broadcast_bytes(None)
        if data == STOP:
            logger.info("rank 0 stopped; exiting")
            return
        if data:  # empty: rank 0's idle heartbeat
            runner.forward(decoder.decode(data))


if __name__ == "__main__":
    main()
