"""Which dtype the model runs in.

`--dtype auto` (when the server arguments allow it) picks bfloat16 where the
processor has native bfloat16 matmuls (AVX512_BF16 / AMX on a CPU; any CUDA
device that supports it), float32 elsewhere: on a CPU without them oneDNN
emulates bfloat16 and is slower than float32. An explicit dtype is used as
given; float32 is what the exact-match tests run.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bfloat16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported ({', '.join(['auto', *DTYPES])})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
