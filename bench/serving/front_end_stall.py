"""What a burst of huge posts costs the streams: issue 17's stall test as a
benchmark, per configuration of the model process's OpenMP runtime.

Six clients stream while ten others post 4 MiB prompts (refused before
tokenizing, twice per round: tests/reliability/test_stall.py's load). Per
configuration one server, ROUNDS quiet and loaded rounds alternated; the
medians of: the streams' largest gap between two events (quiet and loaded),
the slowest decode step of a loaded round (the scheduler's /timeline: the
step the burst lands on), and a quiet round's median step interval (what the
configuration costs when nothing else runs). A configuration is environment
settings for the server (the launcher keeps a user's GOMP_SPINCOUNT and
OMP_WAIT_POLICY), side by side in one run.

    python -m bench.serving.front_end_stall --config default --config GOMP_SPINCOUNT=300000

Output: stdout only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import requests

from tests.e2e.server_process import ServerProcess
from tests.reliability import test_stall as stall
from tests.reliability.server_probe import shut_down


def decode_intervals(url: str, since: float) -> list[tuple[float, float]]:
    """(interval since the previous decode step, its step_time) of each decode step after `since`."""
    events = requests.get(f"{url}/timeline", params={"since": since}, timeout=30).json()["events"]
    steps = [e for e in events if e["type"] == "step" and e["kind"] == "decode"]
    return [(b["t"] - a["t"], b["step_time"]) for a, b in zip(steps, steps[1:])]


def measure(config: str, rounds: int) -> dict[str, float]:
    env = dict(pair.split("=", 1) for pair in config.split(",")) if config != "default" else {}
    srv = ServerProcess("--max-running-requests", "16", env=env)
    quiet_gap, loaded_gap, burst_step, quiet_step = [], [], [], []
    try:
        asyncio.run(stall.run_streams(srv.url, loaded=False))  # warm-up
        for _ in range(rounds):
            since = time.time()
            gap, _, _ = asyncio.run(stall.run_streams(srv.url, loaded=False))
            quiet_gap.append(gap)
            quiet_step.append(statistics.median(i for i, _ in decode_intervals(srv.url, since)))
            since = time.time()
            gap, _, _ = asyncio.run(stall.run_streams(srv.url, loaded=True))
            loaded_gap.append(gap)
            burst_step.append(max(t for _, t in decode_intervals(srv.url, since)))
    finally:
        shut_down(srv)
    return {name: statistics.median(v) * 1000 for name, v in
            (("quiet_gap", quiet_gap), ("loaded_gap", loaded_gap), ("burst_step", burst_step),
             ("quiet_step", quiet_step))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=None,
                    help="'default' or K=V[,K=V] environment for the server (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    configs = args.config or ["default", "GOMP_SPINCOUNT=300000"]
    load_before = os.getloadavg()[0]
    rows = [(c, measure(c, args.rounds)) for c in configs]
    print(f"\nmedians of {args.rounds} rounds each (ms); load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| configuration | quiet: largest gap | quiet: median step | loaded: largest gap | growth "
          "| loaded: slowest step |")
    print("|---|---|---|---|---|---|")
    for c, m in rows:
        print(f"| {c} | {m['quiet_gap']:.0f} | {m['quiet_step']:.1f} | {m['loaded_gap']:.0f} "
              f"| {m['loaded_gap'] - m['quiet_gap']:+.0f} | {m['burst_step']:.0f} |")


if __name__ == "__main__":
    main()
