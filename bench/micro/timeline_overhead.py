"""What recording the timeline costs the scheduler at batch 64.

    python -m bench.micro.timeline_overhead

Runs the real scheduler against a fake model (no forward time) at a steady
batch of 64 rows, once recording and once with recording switched off, and
reports the difference per step next to a real batch-64 decode step.

Output: stdout only
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler_proc.timeline import Timeline
from tests.scheduler.test_scheduler import Harness

BATCH = 64
STEPS = 400


class NoTimeline(Timeline):
    def request(self, *args, **kwargs) -> None:  # type: ignore[override]
        pass

    def step(self, **kwargs) -> None:  # type: ignore[override]
        pass


def time_steps(record: bool) -> float:
    h = Harness(max_running=BATCH, max_total_tokens=BATCH * 600)
    if not record:
        h.sched.timeline = NoTimeline()
    for i in range(BATCH):
        h.submit(f"r{i}", n_prompt=16, max_new=STEPS + 50, ignore_eos=True)
    h.sched.step()  # the prefill
    start = time.perf_counter()
    for _ in range(STEPS):
        h.sched.step()
    return (time.perf_counter() - start) / STEPS


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # no flags: --help only
    on, off = [], []
    for _ in range(5):
        on.append(time_steps(True))
        off.append(time_steps(False))
    on_ms, off_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
    print(f"scheduler step at batch {BATCH} (fake model): recording {on_ms:.3f} ms, "
          f"off {off_ms:.3f} ms, recording costs {max(on_ms - off_ms, 0.0) * 1e3:.1f} us/step")


if __name__ == "__main__":
    main()
