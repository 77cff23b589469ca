"""In-process micro benchmarks: one decode step, attention, the matmuls,
prefill, and what single features cost, timed in this process without a
server (step_bench's `--what server` rows excepted). `python -m bench.catalog`
lists them."""
