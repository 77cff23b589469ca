"""How contended the CPU was during a run, from Linux pressure stall information.

/proc/pressure/cpu's `some total=` counts microseconds in which at least one
runnable task waited for a CPU. Its growth over a run, divided by the run's
wall time, says how much of the run was fought over: on a shared machine a
figure measured at 80% is not comparable with one measured at 20%. The
benchmark's own processes count too (server and client share the cores).
"""

from __future__ import annotations

import argparse
import time

PSI_CPU = "/proc/pressure/cpu"


def some_avg(window: int = 10, path: str = PSI_CPU) -> float | None:
    """Share of the last `window` (10, 60 or 300) seconds in which some task
    waited for a CPU (0..1), as the kernel averages it."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.split(f"avg{window}=", 1)[1].split()[0]) / 100
    except (OSError, ValueError, IndexError):
        pass
    return None


def wait_for_quiet(threshold: float, timeout: float, poll: float = 5.0, path: str = PSI_CPU) -> float | None:
    """Block until the CPU has been quiet for a while (the 10 s and the 60 s
    averages both below threshold) or timeout seconds passed; returns the
    larger of the two last readings. On a shared machine this keeps a mode from
    being measured while someone else's job holds the cores; the 60 s average
    skips the short gaps between another job's bursts."""
    deadline = time.monotonic() + timeout
    while True:
        readings = [some_avg(w, path) for w in (10, 60)]
        level = None if None in readings else max(r for r in readings if r is not None)
        if level is None or level < threshold or time.monotonic() >= deadline:
            return level
        time.sleep(poll)


def some_total_us(path: str = PSI_CPU) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None  # not Linux, or a kernel without PSI


class CpuWait:
    """`with CpuWait() as w: ...` then `w.share`: waited share of the wall time (None if unknown)."""

    def __init__(self, path: str = PSI_CPU) -> None:
        self.path = path
        self.share: float | None = None

    def __enter__(self) -> "CpuWait":
        self._t0, self._w0 = time.monotonic(), some_total_us(self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        w1, elapsed = some_total_us(self.path), time.monotonic() - self._t0
        if self._w0 is not None and w1 is not None and elapsed > 0:
            self.share = (w1 - self._w0) / 1e6 / elapsed


def add_quiet_cpu_args(p: argparse.ArgumentParser, what: str, retries: int) -> None:
    """The flags every side-by-side benchmark shares for measuring on a shared
    machine: wait for a quiet CPU before each `what` (a mode, a point), and
    measure again one that others' jobs contended."""
    p.add_argument("--quiet-threshold", type=float, default=0.3,
                   help=f"before each {what}, wait until the CPU's pressure (/proc/pressure/cpu, some, "
                        "10 s and 60 s averages) is below this share; 1 disables")
    p.add_argument("--quiet-timeout", type=float, default=300.0, help="longest wait for a quiet CPU, s")
    p.add_argument("--max-cpu-wait", type=float, default=0.25,
                   help=f"a {what} with more CPU wait than this (others' jobs) is measured again")
    p.add_argument("--retries", type=int, default=retries, help=f"extra attempts for a contended {what}")
