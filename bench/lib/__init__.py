"""Shared code of the benchmarks: the load client's backends, traces and
metrics, the server launcher, machine rates, CPU pressure, KV layout, and the
batching study's modes and report. Nothing here is run on its own."""
