"""Start a server process for a benchmark, wait until it answers, stop it after.

Used for our own `launch.py` and for `transformers serve`: both answer
GET /health once they can take requests. The server gets its own process
group, so whatever it forks can be killed with it if it does not stop cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unwind_on_sigterm() -> None:
    """A script's SIGTERM unwinds like Ctrl-C, so the server it is measuring is
    stopped too. Set by the scripts' __main__ only: a test that calls their
    main() keeps pytest's own handling."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class LaunchedServer:
    def __init__(self, cmd: list[str], port: int, log_path: str, env: dict[str, str] | None = None,
                 ready_timeout: float = 600.0) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @classmethod
    def ours(cls, flags: list[str], log_path: str) -> "LaunchedServer":
        port = free_port()
        return cls([sys.executable, "launch.py", "--port", str(port), *flags], port, log_path)

    def start(self) -> "LaunchedServer":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout
        while not healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start ({' '.join(self.cmd[:4])} ...):\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # launch.py and uvicorn both shut down cleanly on it
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            try:  # anything it forked and left behind, in the group it was started in
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LaunchedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
