"""What every child process does at start: read its launch config, tie its life
to the parent's, set up logging."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import msgspec

from common.messages import IpcPaths, ModelInfo
from common.server_args import ServerArgs


class ChildConfig(msgspec.Struct):
    """Passed by launch.py to each child as JSON on its command line."""

    server_args: ServerArgs
    ipc: IpcPaths
    model_info: ModelInfo | None = None


def encode_child_config(cfg: ChildConfig) -> str:
    return msgspec.json.encode(cfg).decode()


def child_main_setup(proc_name: str) -> ChildConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = msgspec.json.decode(parser.parse_args().config.encode(), type=ChildConfig)
    die_with_parent()
    setup_logging(cfg.server_args.log_level, proc_name)
    # launch.py owns shutdown: a Ctrl-C in the terminal reaches the whole process
    # group, so children ignore SIGINT and wait for launch.py's SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return cfg


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
