"""The scheduler's watchdog and heartbeat (scheduler_proc/watchdog.py), on a
fake clock."""

from __future__ import annotations

import pytest

from common.messages import SchedulerHeartbeat, ToTokenizerMsg
from scheduler_proc.watchdog import HEARTBEAT_S, Watchdog, WatchdogTimeout


def test_a_model_silent_past_the_limit_raises_and_within_it_does_not() -> None:
    dog = Watchdog(4.0, lambda msg: None)
    dog.tick(4.0, now=1.0)  # at the limit: not yet
    with pytest.raises(WatchdogTimeout, match=r"4\.1 s \(--watchdog-timeout 4\)"):
        dog.tick(4.1, now=1.1)


def test_limit_0_turns_the_watchdog_off_but_not_the_heartbeat() -> None:
    sent: list[ToTokenizerMsg] = []
    Watchdog(0.0, sent.append).tick(10_000.0, now=1.0)
    assert sent == [SchedulerHeartbeat(model_silent_s=10_000.0)]


def test_one_heartbeat_per_interval_carrying_the_models_silence() -> None:
    sent: list[ToTokenizerMsg] = []
    dog = Watchdog(300.0, sent.append)
    for k in range(41):  # 2 s of ticks every 50 ms
        dog.tick(0.05 * k, now=100.0 + 0.05 * k)
    assert len(sent) == int(2.0 / HEARTBEAT_S) + 1
    assert [round(m.model_silent_s, 2) for m in sent] == [0.0, 0.5, 1.0, 1.5, 2.0]
