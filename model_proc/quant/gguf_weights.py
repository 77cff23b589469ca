"""The quantized matmul weights of a GGUF file, by their Hugging Face names,
as `QuantWeight`s holding the file's own blocks (copied into memory once,
not dequantized).

The model's config, tokenizer and small float tensors (norms, biases) still
come from the Hugging Face folder converted once from the same file
(weights.resolve_model_path); only the large 2-D tensors of a block type the
kernels run (ggml_types.SUPPORTED) are taken from here.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import torch

from model_proc.quant import QuantizedWeights
from model_proc.quant.ggml_types import SUPPORTED, GGMLType, row_bytes
from model_proc.quant.gguf_file import GGUFFile
from model_proc.quant.weight import QuantWeight

logger = logging.getLogger(__name__)

# HF-name suffixes the name map is asked with
_SUFFIXES = (".weight", ".bias")


def llama_qk_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (its converter
    interleaves each head's two rotary halves for GGML's rope; transformers'
    GGUF loader undoes it the same way): row (h, j, i) of the result is row
    (h, i, j) of the file, viewing rows as [heads, half, 2] there and
    [heads, 2, half] here."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _type_name(ggml_type: int) -> str:
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


class GGUFWeights(QuantizedWeights):
    """`get(hf_name)`: that tensor's blocks, or None where the file holds it
    as floats (or in a block type without a kernel here)."""

    def __init__(self, path: str, hf_names: list[str], num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        file = GGUFFile(path)
        arch_name = file.metadata["general.architecture"]
        archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        if arch_name not in archs:
            raise ValueError(f"{path}: GGUF architecture {arch_name!r} unknown to gguf-py")
        tensors = file.tensors
        blocks = max((int(n.split(".")[1]) + 1 for n in tensors if n.startswith("blk.")), default=0)
        name_map = gguf.get_tensor_name_map(archs[arch_name], blocks)
        for hf in hf_names:
            gg = name_map.get_name(hf, try_suffixes=_SUFFIXES)
            t = tensors.get(gg) if gg is not None else None
            if t is None or len(t.shape) != 2:
                continue
            try:
                qtype = GGMLType(t.ggml_type)
            except ValueError:
                qtype = None
            if qtype not in SUPPORTED:
                self.float_types[hf] = f"{_type_name(t.ggml_type)} in the file, dequantized"
                continue
            k, n = t.shape  # GGUF lists dimensions innermost first
            # copied out of the mapping: the weights stay in memory, not in the page cache
            data = np.array(file.tensor_bytes(t, row_bytes(qtype, k) * n)).reshape(n, row_bytes(qtype, k))
            w = QuantWeight.of(qtype, torch.from_numpy(data), k)
            if arch_name == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = num_heads if hf.endswith("q_proj.weight") else num_kv_heads
                w = w.take_rows(llama_qk_order(w.shape[0], heads))
            self._weights[hf] = w
        self.arch = arch_name
