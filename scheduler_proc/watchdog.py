"""The scheduler's liveness: a heartbeat to the front end, and the watchdog
that ends the process when the model stops answering (SGLang's
--watchdog-timeout: a hung engine must end as a crash does, so that a
supervisor restarts it)."""

from __future__ import annotations

import time
from typing import Callable

from common.messages import SchedulerHeartbeat, ToTokenizerMsg

# how often the loop tells the front end it is alive (a SchedulerHeartbeat),
# idle, busy or waiting for the model; the front end's bounds are many of these
HEARTBEAT_S = 0.5


class WatchdogTimeout(RuntimeError):
    """The model has not answered a step for --watchdog-timeout seconds."""


class Watchdog:
    """`tick` is called every loop iteration and, while the scheduler waits
    for the model, every HEARTBEAT_S. `limit` 0 turns the watchdog off (the
    heartbeat still goes)."""

    def __init__(self, limit_s: float, send: Callable[[ToTokenizerMsg], None]) -> None:
        self.limit_s = limit_s
        self.send = send
        self.last_heartbeat = 0.0  # time.perf_counter() of the last SchedulerHeartbeat

    def tick(self, model_silent_s: float, now: float | None = None) -> None:
        """Raises WatchdogTimeout once the model has owed a step for longer
        than the limit; sends the heartbeat when one is due."""
        now = time.perf_counter() if now is None else now
        if self.limit_s and model_silent_s > self.limit_s:
            raise WatchdogTimeout(f"the model process has not answered a step for {model_silent_s:.1f} s "
                                  f"(--watchdog-timeout {self.limit_s:g})")
        if now - self.last_heartbeat >= HEARTBEAT_S:
            self.last_heartbeat = now
            self.send(SchedulerHeartbeat(model_silent_s=model_silent_s))
