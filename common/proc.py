"""What every child process does at start: read its launch config, tie its life
to the parent's, set up logging, wait for the model's ModelInfo (the scheduler
and the tokenizer process); and, once it is set up, put its startup heap out of
the garbage collector's reach."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time

import msgspec

from common.messages import IpcPaths, ModelInfo
from common.peer_watch import socket_dir
from common.server_args import ServerArgs


CHILD_CONFIG_ENV = "BATCHSERVE_CHILD_CONFIG"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_INFO_FILE = "model_info.json"  # in the private socket folder, once the model is ready
MODEL_INFO_POLL_S = 0.01


class ChildConfig(msgspec.Struct):
    """Passed by launch.py to each child as JSON in its environment (not on its
    command line, where any local user could read an --api-key)."""

    server_args: ServerArgs
    ipc: IpcPaths
    model_info: ModelInfo | None = None
    tp_rank: int = 0  # a model process's tensor-parallel rank (global, across nodes)


def model_proc_name(tp_rank: int) -> str:
    """A model rank's name in ReadyMsg, pids.json and the logs: rank 0 is
    "model" (the one the scheduler talks to), the others "model_tp<rank>"."""
    return "model" if tp_rank == 0 else f"model_tp{tp_rank}"


def child_env(cfg: ChildConfig) -> dict[str, str]:
    """The environment to start a child with: ours, the repo on PYTHONPATH, the config."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env[CHILD_CONFIG_ENV] = msgspec.json.encode(cfg).decode()
    return env


def child_main_setup(proc_name: str) -> ChildConfig:
    raw = os.environ.pop(CHILD_CONFIG_ENV, None)
    if raw is None:
        sys.exit(f"{proc_name}: no {CHILD_CONFIG_ENV} in the environment; start it with launch.py")
    cfg = msgspec.json.decode(raw.encode(), type=ChildConfig)
    die_with_parent()
    setup_logging(cfg.server_args.log_level, proc_name)
    # launch.py owns shutdown: a Ctrl-C in the terminal reaches the whole process
    # group, so children ignore SIGINT and wait for launch.py's SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return cfg


def publish_model_info(folder: str, info: ModelInfo) -> None:
    """launch.py, once model rank 0 is ready: the ModelInfo the scheduler and
    the tokenizer process wait for, written atomically."""
    tmp = os.path.join(folder, MODEL_INFO_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(info))
    os.replace(tmp, os.path.join(folder, MODEL_INFO_FILE))


def wait_model_info(cfg: ChildConfig) -> ModelInfo:
    """The model's ModelInfo: from the config where launch.py had it at the
    start, else from the socket folder once the model is ready. launch.py starts
    the scheduler and the tokenizer process beside the model process, so their
    imports (transformers in the front end, ~1.5 s) overlap its load instead of following it; if
    the model fails to start, launch.py stops this process while it waits."""
    if cfg.model_info is not None:
        return cfg.model_info
    path = os.path.join(socket_dir(cfg.ipc), MODEL_INFO_FILE)
    while True:
        try:
            with open(path, "rb") as f:
                cfg.model_info = msgspec.json.decode(f.read(), type=ModelInfo)
            return cfg.model_info
        except FileNotFoundError:
            time.sleep(MODEL_INFO_POLL_S)


def freeze_startup_heap() -> None:
    """Called once a process is set up, before it serves: every object alive
    now (imported modules, the tokenizer, the model's Python objects) moves to
    the collector's permanent generation, so a full collection walks only
    what serving allocated since. Without it, a full collection of the front
    end's heap, set off by a burst of connections, stalled every stream for
    267 ms (tests/reliability/test_slow_connections.py)."""
    gc.collect()
    gc.freeze()


def die_with_parent() -> None:
    """Ask Linux to SIGTERM us when launch.py dies, so no child outlives it."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before prctl took effect
            sys.exit(1)


def setup_logging(level: str, proc_name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {proc_name}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
