"""The GGUF block types served as they are: their gguf numbers and block
shapes, the one table the rest of model_proc/quant reads (the native op lays
the same blocks out in C++; the tests check both against gguf-py's
GGML_QUANT_SIZES)."""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """gguf's numbering (gguf.GGMLQuantizationType) of the supported types."""
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# (weights, bytes) per block
_BLOCK_SHAPES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 18),   # fp16 d, 16 bytes of nibbles
    GGMLType.Q4_1: (32, 20),   # fp16 d and m, 16 bytes of nibbles
    GGMLType.Q5_0: (32, 22),   # fp16 d, 4 bytes of fifth bits (qh), 16 of nibbles
    GGMLType.Q5_1: (32, 24),   # fp16 d and m, qh, 16 bytes of nibbles
    GGMLType.Q8_0: (32, 34),   # fp16 d, 32 int8
    GGMLType.Q4_K: (256, 144),  # fp16 d and dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
    GGMLType.Q5_K: (256, 176),  # as Q4_K plus 32 bytes of fifth bits
    GGMLType.Q6_K: (256, 210),  # 128 bytes low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
}

# where in a block its fp16 fields lie (d; Q4_1's and Q5_1's m; the K-quants'
# dmin): the bytes that must hold finite values, for tests and benchmarks making blocks
_FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2), GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}

SUPPORTED: frozenset[GGMLType] = frozenset(_BLOCK_SHAPES)


def ggml_type(qtype: int) -> GGMLType:
    """`qtype` as a GGMLType; ValueError naming the supported types if it is none of them."""
    try:
        return GGMLType(qtype)
    except ValueError:
        names = ", ".join(f"{t.name}={t.value}" for t in GGMLType)
        raise ValueError(f"unsupported GGML type {qtype!r} (supported: {names})") from None


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights, bytes) per block of `qtype`."""
    return _BLOCK_SHAPES[ggml_type(qtype)]


def fp16_fields(qtype: int) -> tuple[int, ...]:
    """Byte offsets in a block of `qtype` of its fp16 scales."""
    return _FP16_FIELDS[ggml_type(qtype)]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` weights of `qtype`; ValueError unless k is a
    positive multiple of the type's block."""
    weights, nbytes = block_shape(qtype)
    if k <= 0 or k % weights:
        raise ValueError(f"k = {k} is not a positive multiple of {ggml_type(qtype).name}'s {weights}-weight block")
    return k // weights * nbytes
