"""Speculative decoding: where drafts come from (ngram.py) and when to verify them (policy.py)."""
