"""How contended the CPU was during a run, from Linux pressure stall information.

/proc/pressure/cpu's `some total=` counts microseconds in which at least one
runnable task waited for a CPU. Its growth over a run, divided by the run's
wall time, says how much of the run was fought over: on a shared machine a
figure measured at 80% is not comparable with one measured at 20%. The
benchmark's own processes count too (server and client share the cores).
"""

from __future__ import annotations

import time

PSI_CPU = "/proc/pressure/cpu"


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
