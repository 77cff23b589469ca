"""Start the server: `python launch.py [--max-running-requests N] ...`.

Starts the model process, then (with the model's limits in hand) the scheduler
and the tokenizer/HTTP process; they talk only over ZMQ ipc:// sockets in a
private 0700 folder, removed at exit.

Tensor parallelism (`--tp-size N`): N model processes, one per rank, in one
torch.distributed group; rank 0 is the one the scheduler talks to. Over
several machines (`--nnodes M --node-rank K --dist-init-addr HOST:PORT`, as
SGLang spells them) each machine runs `launch.py` with its own --node-rank
and starts its N / M ranks; only node 0 also runs the scheduler and the
tokenizer/HTTP process.

Stopping:
- Ctrl-C or SIGTERM: an orderly stop, front to back. The tokenizer process
  stops accepting and lets requests in flight finish (up to
  --shutdown-timeout, then aborts them); once it has exited, the scheduler and
  the model are stopped. Exit code 0. A second Ctrl-C/SIGTERM cuts the wait
  short.
- A child dies: the tokenizer process is told (SIGUSR1) to end everything in
  flight with an error at once, every other child is stopped, exit code 1.
Children also watch each other (`common.peer_watch`) and die with launch.py
(PR_SET_PDEATHSIG), so none outlives the server even if launch.py is killed.
Each child runs in a process group of its own: a signal sent to launch.py's
whole group (`timeout`, `kill -TERM -PGID`, a terminal's Ctrl-C) reaches
launch.py alone, which then stops the children in order instead of the model
process dying under requests still in flight.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import zmq

from common.cpu_runtime import CpuAllocator, allocator_preload, with_omp_spin, with_preload
from common.ipc import PullSocket
from common.messages import IpcPaths, ReadyMsg
from common.peer_watch import remove_pids, write_pids, write_stop_reason
from common.proc import ChildConfig, child_env, model_proc_name, publish_model_info, setup_logging
from common.server_args import ServerArgs

logger = logging.getLogger("launch")
ROOT = os.path.dirname(os.path.abspath(__file__))
CHILD_STOP_TIMEOUT_S = 5.0  # SIGTERM to SIGKILL, for the scheduler and the model
TOKENIZER_STOP_MARGIN_S = 5.0  # on top of --shutdown-timeout: handlers answering, cleanup
FAIL_FAST_WAIT_S = 5.0  # a child died: how long the tokenizer gets to answer everyone
POLL_S = 0.1


class ChildDied(RuntimeError):
    pass


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        # raises (before anything starts) when --cpu-allocator tcmalloc is not installed
        self.model_preload = allocator_preload(CpuAllocator(args.cpu_allocator), args.device)
        self.ipc_dir = tempfile.mkdtemp(prefix="batchserve-")  # created 0700
        os.chmod(self.ipc_dir, 0o700)
        self.ipc = IpcPaths.in_dir(self.ipc_dir)
        self.ctx = zmq.Context()
        self.ready: PullSocket[ReadyMsg] = PullSocket(self.ctx, self.ipc.launcher, ReadyMsg)
        self.children: dict[str, subprocess.Popen] = {}
        self.signals_received = 0  # Ctrl-C/SIGTERM count: the first stops, the second hurries

    @property
    def stop_requested(self) -> bool:
        return self.signals_received > 0

    def spawn(self, name: str, module: str, tp_rank: int = 0) -> None:
        cfg = ChildConfig(server_args=self.args, ipc=self.ipc, tp_rank=tp_rank)
        env = child_env(cfg)
        if module == "model_proc":  # its allocator and OpenMP settings must be in place before it starts
            env = with_omp_spin(with_preload(env, self.model_preload), self.args.device)
        self.children[name] = subprocess.Popen([sys.executable, "-m", module],
                                               env=env, cwd=ROOT, process_group=0)

    def dead_child(self) -> str | None:
        """A message naming the first child that has exited, or None."""
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                return f"the {name} process exited with code {code}"
        return None

    def check_children(self) -> None:
        dead = self.dead_child()
        if dead is not None:
            raise ChildDied(dead)

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

    def local_tp_ranks(self) -> list[int]:
        """The tensor-parallel ranks this node runs (rank 0 lives on node 0)."""
        per_node = self.args.tp_ranks_per_node
        return list(range(self.args.node_rank * per_node, (self.args.node_rank + 1) * per_node))

    def spawn_model_ranks(self) -> set[str]:
        if self.args.tp_size > 1 and not self.args.dist_init_addr:
            self.args.dist_init_addr = f"127.0.0.1:{free_port()}"  # one node: a local rendezvous
        names = set()
        for rank in self.local_tp_ranks():
            names.add(model_proc_name(rank))
            self.spawn(model_proc_name(rank), "model_proc", tp_rank=rank)
        if self.args.tp_size > 1:
            logger.info("model ranks %s of %d started (rendezvous %s)", sorted(names),
                        self.args.tp_size, self.args.dist_init_addr)
        return names

    def run(self) -> int:
        logger.info("ZMQ ipc sockets in %s", self.ipc_dir)
        model_names = self.spawn_model_ranks()
        if self.args.node_rank > 0:
            return self.run_model_node(model_names)
        # started now, they import while the model loads, then wait for its ModelInfo
        self.spawn("scheduler", "scheduler_proc")
        self.spawn("tokenizer", "tokenizer_proc")
        write_pids(self.ipc_dir, {name: p.pid for name, p in self.children.items()})
        # rank 0 is ready only once every rank has joined and loaded its shard
        model_info = self.wait_ready(model_names)["model"].model_info
        assert model_info is not None
        logger.info("model ready: %s, context %d, KV pool %d tokens (%.1f MiB)",
                    model_info.model_path, model_info.context_len, model_info.max_total_tokens,
                    model_info.kv_cache_bytes / 2**20)
        publish_model_info(self.ipc_dir, model_info)
        self.wait_ready({"scheduler", "tokenizer"})
        print(f"The server is ready at http://{self.args.host}:{self.args.port}", flush=True)
        while not self.stop_requested:
            self.check_children()
            time.sleep(POLL_S)
        return self.stop_in_order()

    def run_model_node(self, model_names: set[str]) -> int:
        """--node-rank > 0: this node's model ranks only. They follow rank 0
        (on node 0) until it goes; a rank that dies here breaks node 0's next
        collective, which takes the server down."""
        self.wait_ready(model_names)
        write_pids(self.ipc_dir, {name: p.pid for name, p in self.children.items()})
        ranks = self.local_tp_ranks()
        print(f"Node {self.args.node_rank} is ready: model ranks {ranks[0]}..{ranks[-1]} of "
              f"{self.args.tp_size} joined {self.args.dist_init_addr}", flush=True)
        while not self.stop_requested:
            codes = [p.poll() for p in self.children.values()]
            if all(code == 0 for code in codes):  # rank 0 told them to stop: node 0 stopped in order
                logger.info("node 0 stopped the model ranks; exiting")
                return 0
            if any(code not in (None, 0) for code in codes):
                self.check_children()  # raises ChildDied
            time.sleep(POLL_S)
        return 0

    # ---- stopping -----------------------------------------------------------------------

    def signal_tokenizer(self, sig: int) -> None:
        proc = self.children.get("tokenizer")
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def abort_in_flight(self, reason: str) -> None:
        """Tells the tokenizer process to end every request now, saying why."""
        write_stop_reason(self.ipc_dir, reason)
        self.signal_tokenizer(signal.SIGUSR1)

    def wait_tokenizer(self, timeout: float, on_tick: Callable[[], None] | None = None) -> bool:
        """Waits up to `timeout` s for the tokenizer process to exit; True if it did."""
        proc = self.children.get("tokenizer")
        deadline = time.monotonic() + timeout
        while proc is not None and proc.poll() is None:
            if time.monotonic() >= deadline:
                return False
            if on_tick is not None:
                on_tick()
            time.sleep(POLL_S)
        return True

    def stop_in_order(self) -> int:
        """Ctrl-C/SIGTERM: the tokenizer drains first; the scheduler and model
        keep serving it meanwhile and are stopped (in `shutdown`) once it is gone."""
        logger.info("stopping: requests in flight get up to %g s (--shutdown-timeout)",
                    self.args.shutdown_timeout)
        remove_pids(self.ipc_dir)  # from now on launch.py alone decides who stops when
        self.signal_tokenizer(signal.SIGTERM)
        hurried = False
        exit_code = 0

        def on_tick() -> None:
            nonlocal hurried, exit_code
            if hurried:
                return
            dead = self.dead_child()
            if self.signals_received > 1 or (dead is not None and "tokenizer" not in dead):
                reason = dead or "asked twice to stop"
                logger.warning("%s: aborting the requests in flight now", reason)
                exit_code = 1 if dead is not None else 0
                hurried = True
                self.abort_in_flight(reason)

        timeout = self.args.shutdown_timeout + TOKENIZER_STOP_MARGIN_S
        if not self.wait_tokenizer(timeout, on_tick):
            logger.error("the tokenizer process did not stop within %g s; killing it", timeout)
            self.children["tokenizer"].kill()
        if any(p.poll() is not None for n, p in self.children.items() if n != "tokenizer"):
            exit_code = 1  # a child died while the tokenizer drained: not a clean stop
        if not hurried and self.children["tokenizer"].poll() != 0:
            exit_code = 1  # it failed, or had to be killed
        return exit_code

    def fail_fast(self, reason: str) -> None:
        """A child died: the tokenizer process answers every client with an
        error (it may have noticed already) before the rest is taken down."""
        logger.error("%s; shutting the server down", reason)
        remove_pids(self.ipc_dir)
        self.abort_in_flight(reason)
        self.wait_tokenizer(FAIL_FAST_WAIT_S)

    def shutdown(self) -> None:
        """Stops every child still running (SIGTERM, then SIGKILL), removes the sockets.
        Tensor-parallel rank 0 goes first: it tells every other rank, on every
        node, to stop (so that they exit 0), and then they are gone too."""
        rank0 = self.children.get("model")
        if self.args.tp_size > 1 and rank0 is not None and rank0.poll() is None:
            terminate(rank0)
            try:
                rank0.wait(timeout=CHILD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.children.values():
            if proc.poll() is None:
                terminate(proc)
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


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGCONT (as systemd does): a stopped child (SIGSTOP, a
    debugger's) takes the SIGTERM now, not after the SIGKILL wait."""
    proc.terminate()
    try:
        proc.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli(argv)
    setup_logging(args.log_level, "launch")
    try:
        launcher = Launcher(args)
    except RuntimeError as e:
        logger.error("%s", e)
        return 2

    def on_signal(signum: int, frame: object) -> None:
        launcher.signals_received += 1
        logger.info("received %s, %s", signal.Signals(signum).name,
                    "shutting down" if launcher.signals_received == 1 else "hurrying")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return launcher.run()
    except ChildDied as e:
        launcher.fail_fast(str(e))
        return 1
    except KeyboardInterrupt:  # stopped while starting: nothing is in flight yet
        return 0
    finally:
        launcher.shutdown()


if __name__ == "__main__":
    sys.exit(main())
