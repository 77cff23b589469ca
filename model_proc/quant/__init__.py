"""Linear layers on GGUF-quantized weights, served as the file stores them
(issue 31): the block types (ggml_types), their dequantization in torch
(dequant, the reference and the fallback) and the matmul that runs on the
blocks themselves (matmul: the native op model_proc/native/quant.cpp for
decode, row tiles dequantized on the fly for prefill), with no float copy of
a weight kept.

A Hugging Face folder's float weights can be rounded into the same blocks at
load (quantize: `--quantization int8 / int4 / w8a8_int8`)."""

from __future__ import annotations

from model_proc.quant.weight import QuantWeight


class QuantizedWeights:
    """The matmul weights a model takes as blocks, by Hugging Face name: a
    GGUF file's (gguf_weights.GGUFWeights) or a folder's rounded at load
    (quantize.QuantizedAtLoad); each fills `_weights` and `float_types`."""

    def __init__(self) -> None:
        self._weights: dict[str, QuantWeight] = {}
        self.float_types: dict[str, str] = {}  # matmul weights left in --dtype, and why (for the start-up log)

    def get(self, hf_name: str) -> QuantWeight | None:
        """That weight's blocks, or None where it stays a float tensor."""
        return self._weights.get(hf_name)

    @property
    def nbytes(self) -> int:
        """Bytes of every weight held as blocks (a tied embedding counts once)."""
        return sum(w.nbytes for w in self._weights.values())

    def __len__(self) -> int:
        return len(self._weights)
