"""Figures: a recorded scheduler timeline as a PNG, and the batching study's
plots (matplotlib, the `bench` extra)."""
