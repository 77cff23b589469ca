"""common.peer_watch on its own: telling live, dead and reused pids apart."""

from __future__ import annotations

import os
import subprocess
import sys

from common.messages import IpcPaths
from common.peer_watch import PeerWatch, read_pids, read_stop_reason, remove_pids, start_time, \
    write_pids, write_stop_reason


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_start_time_is_none_for_a_zombie_and_a_reaped_process() -> None:
    assert start_time(os.getpid()) is not None
    proc = sleeper()
    assert start_time(proc.pid) is not None
    proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
    assert start_time(proc.pid) is None
    proc.wait()
    assert start_time(proc.pid) is None


def test_a_watch_names_the_peer_that_died(tmp_path) -> None:
    ipc = IpcPaths.in_dir(str(tmp_path))
    peer = sleeper()
    try:
        watch = PeerWatch(ipc, "model")
        assert watch.lost() is None  # no pids.json yet: only the parent is checked
        write_pids(str(tmp_path), {"model": os.getpid(), "scheduler": peer.pid})
        assert read_pids(str(tmp_path))["scheduler"][0] == peer.pid
        assert watch.lost() is None
        peer.kill()
        peer.wait()
        assert watch.lost() == "the scheduler process exited"
        remove_pids(str(tmp_path))  # an orderly stop: launch.py takes over
        assert watch.lost() is None
    finally:
        peer.kill()
        peer.wait()


def test_a_reused_pid_is_not_a_live_peer(tmp_path) -> None:
    ipc = IpcPaths.in_dir(str(tmp_path))
    (tmp_path / "pids.json").write_text(f'{{"scheduler": [{os.getpid()}, 1]}}')  # wrong start time
    assert PeerWatch(ipc, "model").lost() == "the scheduler process exited"


def test_stop_reason_round_trip(tmp_path) -> None:
    assert read_stop_reason(str(tmp_path), "default") == "default"
    write_stop_reason(str(tmp_path), "the model process exited with code -9")
    assert read_stop_reason(str(tmp_path), "default") == "the model process exited with code -9"
