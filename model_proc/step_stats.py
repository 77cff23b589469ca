"""The model process's view of steady decoding: how much of each step's wall
time is its own forward, and how much is spent outside it (scheduler work,
IPC, message encoding) before the next batch arrives.

A step's cycle runs from its forward's start to the next forward's start.
Only decode-after-decode cycles count: the scheduler never idles between
two decode steps (an empty running batch needs a prefill first), so such a
cycle is forward + overhead, never waiting for traffic.
"""

from __future__ import annotations

import logging

from common.messages import ForwardMode

logger = logging.getLogger(__name__)

LOG_INTERVAL = 40  # counted cycles between log lines, as the scheduler's "Decode batch." line


class DecodeStepStats:
    def __init__(self, interval: int = LOG_INTERVAL) -> None:
        self.interval = interval
        self.prev: tuple[float, float, int] | None = None  # last decode step: start, forward s, rows
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.forward_s = 0.0
        self.cycle_s = 0.0
        self.min_rows = 1 << 30
        self.max_rows = 0

    def record(self, mode: ForwardMode, rows: int, start: float, forward_s: float) -> None:
        """Called once per forward, with its start time and duration."""
        decode = mode is ForwardMode.DECODE
        if decode and self.prev is not None:
            prev_start, prev_forward, prev_rows = self.prev
            self.steps += 1
            self.forward_s += prev_forward
            self.cycle_s += start - prev_start
            self.min_rows = min(self.min_rows, prev_rows)
            self.max_rows = max(self.max_rows, prev_rows)
            if self.steps == self.interval:
                self.log()
        self.prev = (start, forward_s, rows) if decode else None

    def log(self) -> None:
        # parsed by bench/micro/step_bench.py: keep the wording
        logger.debug(
            "Model decode steps: %d, #rows: %d-%d, forward ms/step: %.2f, step ms: %.2f, "
            "outside forward: %.1f%%", self.steps, self.min_rows, self.max_rows,
            1e3 * self.forward_s / self.steps, 1e3 * self.cycle_s / self.steps,
            100.0 * (1.0 - self.forward_s / self.cycle_s) if self.cycle_s > 0 else 0.0)
        self._reset()
