"""Benchmarks against a running server (ours, launched by the benchmark, or a
peer's): the load client itself and the studies built on it.
`python -m bench.catalog` lists them."""
