"""What a model's decode step must read and compute at the least, from its config.

Shared by the floors of bench/micro/step_bench.py and bench/serving/peers.py.
Only the matmul weights count: every family's extras (Qwen3's and Gemma 3's
q/k norms, Gemma's sandwich norms, biases) are vectors, a rounding error
beside them; GELU or SiLU is elementwise. A tied LM head is the embedding
matrix, read once; an untied one is read once too, and the embedding rows a
step looks up are B rows, nothing. A sliding layer (cfg.layer_windows) reads
min(context, window) tokens of K/V, a full layer all of them.
"""

from __future__ import annotations

from model_proc.model_config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Every layer's q/k/v/o and gate/up/down, plus the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    # a config read without layer types (a hand-made ModelConfig) is all full attention
    return list(cfg.layer_windows) or [None] * cfg.num_layers


def keys_read(cfg: ModelConfig, context: int) -> int:
    """(token, layer) pairs of K/V one row at `context` tokens reads in a step:
    each layer's keys, a sliding layer only those inside its window."""
    return sum(context if w is None else min(context, w) for w in layer_windows(cfg))


def kv_bytes_per_key(cfg: ModelConfig, elem: int) -> int:
    """K and V of one token in one layer."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * elem


def attention_flops_per_key(cfg: ModelConfig) -> int:
    """QK^T and PV of one query against one key in one layer, every q head."""
    return 4 * cfg.num_heads * cfg.head_dim
