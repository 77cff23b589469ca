"""Start and stop a real `launch.py` server for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of `n` consecutive ports that are all free now, below the
    kernel's ephemeral range (32768 and up on Linux): a port next to one the
    kernel handed out may be any client connection's local port (the full
    suite leaves thousands), which a server's bind then fails on."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports between 20000 and 32000")


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the field after the ")" that closes the command name: state, then ppid
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    def __init__(self, *flags: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        """`env`: settings added to this process's environment for the server."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "launch.py", "--port", str(self.port), *flags], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **env} if env else None)
        self._ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("server did not start:\n" + "".join(self.log[-50:]))
        self.child_pids = children_of(self.proc.pid)

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if "The server is ready at" in line:
                self._ready.set()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """Stops whatever is left: a second SIGINT (launch.py then aborts what is
        in flight and removes its socket folder), SIGKILL to the group if that
        does not end it within seconds."""
        if self.proc.poll() is None:
            try:
                for _ in range(2):
                    self.proc.send_signal(signal.SIGINT)
                    time.sleep(0.1)
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the group still holds
        except ProcessLookupError:
            pass
        self.proc.wait()
