"""Start the server: `python launch.py [--max-running-requests N] ...`.

Starts the model process, then (with the model's limits in hand) the scheduler
and the tokenizer/HTTP process; they talk only over ZMQ ipc:// sockets in a
private 0700 folder, removed at exit. Ctrl-C or SIGTERM stops every child; if a
child dies, the whole server exits non-zero instead of hanging.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from common.ipc import PullSocket
from common.messages import IpcPaths, ModelInfo, ReadyMsg
from common.proc import ChildConfig, child_env, setup_logging
from common.server_args import ServerArgs

logger = logging.getLogger("launch")
ROOT = os.path.dirname(os.path.abspath(__file__))
CHILD_STOP_TIMEOUT_S = 5.0


class ChildDied(RuntimeError):
    pass


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="batchserve-")  # created 0700
        os.chmod(self.ipc_dir, 0o700)
        self.ipc = IpcPaths.in_dir(self.ipc_dir)
        self.ctx = zmq.Context()
        self.ready: PullSocket[ReadyMsg] = PullSocket(self.ctx, self.ipc.launcher, ReadyMsg)
        self.children: dict[str, subprocess.Popen] = {}
        self.stop_requested = False

    def spawn(self, name: str, module: str, model_info: ModelInfo | None) -> None:
        cfg = ChildConfig(server_args=self.args, ipc=self.ipc, model_info=model_info)
        self.children[name] = subprocess.Popen([sys.executable, "-m", module],
                                               env=child_env(cfg), cwd=ROOT)

    def check_children(self) -> None:
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                raise ChildDied(f"the {name} process exited with code {code}")

    def wait_ready(self, names: set[str]) -> dict[str, ReadyMsg]:
        got: dict[str, ReadyMsg] = {}
        while set(got) != names:
            if self.stop_requested:
                raise KeyboardInterrupt
            self.check_children()
            msg = self.ready.recv(timeout_ms=200)
            if msg is not None:
                got[msg.proc] = msg
        return got

    def run(self) -> int:
        logger.info("ZMQ ipc sockets in %s", self.ipc_dir)
        self.spawn("model", "model_proc", None)
        model_info = self.wait_ready({"model"})["model"].model_info
        assert model_info is not None
        logger.info("model ready: %s, context %d, KV pool %d tokens (%.1f MiB)",
                    model_info.model_path, model_info.context_len, model_info.max_total_tokens,
                    model_info.kv_cache_bytes / 2**20)
        self.spawn("scheduler", "scheduler_proc", model_info)
        self.spawn("tokenizer", "tokenizer_proc", model_info)
        self.wait_ready({"scheduler", "tokenizer"})
        print(f"The server is ready at http://{self.args.host}:{self.args.port}", flush=True)
        while not self.stop_requested:
            self.check_children()
            time.sleep(0.2)
        return 0

    def shutdown(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.ready.close()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli(argv)
    setup_logging(args.log_level, "launch")
    launcher = Launcher(args)

    def on_signal(signum: int, frame: object) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        launcher.stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launcher.run()
    except ChildDied as e:
        logger.error("%s; shutting the server down", e)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        launcher.shutdown()


if __name__ == "__main__":
    sys.exit(main())
