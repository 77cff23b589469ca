"""Each child watches launch.py and its two siblings, so that no process
outlives the server or waits forever on a dead peer.

PR_SET_PDEATHSIG (common/proc.py) covers launch.py dying; this covers what it
cannot: a sibling that died while launch.py could not act (stopped, stuck, or
killed a moment earlier), and a scheduler blocked on a socket whose model is
gone. launch.py writes the children's pids, each with its start time (so that
a reused pid is not taken for a live peer), into `pids.json` in the private
socket folder once all three are started, and removes the file when it begins
an orderly stop (from then on it stops the children itself, in order). A
child that finds no file checks its parent only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from common.messages import IpcPaths

PIDS_FILE = "pids.json"
STOP_REASON_FILE = "stop_reason"  # why launch.py asked for an abort-everything stop
POLL_S = 0.25  # how often a child looks; a dead peer is noticed within this


def socket_dir(ipc: IpcPaths) -> str:
    """The private folder that holds every ipc:// socket (and pids.json)."""
    return os.path.dirname(ipc.launcher.removeprefix("ipc://"))


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is
    gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3 (state)


def write_pids(folder: str, pids: dict[str, int]) -> None:
    """launch.py: publish the children's identities, atomically (no reader
    ever sees half a file)."""
    entries = {name: [pid, start_time(pid) or 0] for name, pid in pids.items()}
    tmp = os.path.join(folder, PIDS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(entries, f)
    os.replace(tmp, os.path.join(folder, PIDS_FILE))


def remove_pids(folder: str) -> None:
    try:
        os.unlink(os.path.join(folder, PIDS_FILE))
    except OSError:
        pass


def read_pids(folder: str) -> dict[str, tuple[int, int]]:
    try:
        with open(os.path.join(folder, PIDS_FILE)) as f:
            raw = json.load(f)
        return {str(name): (int(v[0]), int(v[1])) for name, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}  # absent (not written yet, or an orderly stop began)


def write_stop_reason(folder: str, reason: str) -> None:
    """launch.py, before it signals "abort everything now": the reason the
    clients should read (a signal carries no text)."""
    tmp = os.path.join(folder, STOP_REASON_FILE + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(reason)
        os.replace(tmp, os.path.join(folder, STOP_REASON_FILE))
    except OSError:
        pass  # the reason is a courtesy; the stop happens anyway


def read_stop_reason(folder: str, default: str) -> str:
    try:
        with open(os.path.join(folder, STOP_REASON_FILE)) as f:
            return f.read().strip() or default
    except OSError:
        return default


class PeerWatch:
    """Answers "should this process stop, and why?" for one child."""

    def __init__(self, ipc: IpcPaths, own_name: str) -> None:
        self.folder = socket_dir(ipc)
        self.own_name = own_name
        self.parent = os.getppid()

    @property
    def parent_gone(self) -> bool:
        # An orphan is re-parented (to init or a subreaper): the ppid changes.
        return os.getppid() != self.parent

    def lost(self) -> str | None:
        """Why this process should stop (launch.py or a sibling is gone), or None."""
        if self.parent_gone:
            return "launch.py exited"
        for name, (pid, started) in read_pids(self.folder).items():
            if name != self.own_name and start_time(pid) != started:
                return f"the {name} process exited"
        return None

    def remove_socket_dir_if_orphaned(self) -> None:
        """With launch.py gone nobody else will remove the socket folder."""
        if self.parent_gone:
            shutil.rmtree(self.folder, ignore_errors=True)


def watch_in_thread(watch: PeerWatch, on_lost: Callable[[str], None]) -> threading.Thread:
    """Polls `watch` on a daemon thread (the main thread may block on a socket
    or in a long forward for any time) and calls `on_lost(reason)` once."""

    def run() -> None:
        while True:
            reason = watch.lost()
            if reason is not None:
                on_lost(reason)
                return
            time.sleep(POLL_S)

    thread = threading.Thread(target=run, name="peer-watch", daemon=True)
    thread.start()
    return thread


def exit_when_lost(watch: PeerWatch, logger: logging.Logger) -> threading.Thread:
    """For the scheduler and the model: nothing there is worth saving once a
    peer is gone (the tokenizer process answers the clients), so leave at once,
    even if the main thread is stuck in a blocking receive."""

    def on_lost(reason: str) -> NoReturn:
        logger.error("%s; exiting", reason)
        watch.remove_socket_dir_if_orphaned()
        os._exit(1)

    return watch_in_thread(watch, on_lost)
