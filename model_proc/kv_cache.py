"""KV storage on the model side: the per-layer K/V slot buffers and the
`req_to_token` table that maps (request row, position) to a slot.

The scheduler owns which slots and rows are free; this module only stores.
"""

from __future__ import annotations

import logging

import torch

from common.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.25  # of MemAvailable, when neither --max-total-tokens nor --mem-fraction-static is given
GPU_MEM_FRACTION_STATIC = 0.88  # weights + KV share of a GPU's memory, when not given


class KVPool:
    """Per layer `k_buffer[l]`, `v_buffer[l]`: `[size + 1, num_kv_heads, head_dim]`.

    Slot 0 is the dummy target for padded tokens, so real slots are 1..size.
    """

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        self.size = size
        self.num_layers = num_layers
        shape = (size + 1, num_kv_heads, head_dim)
        # empty, not zeros: on CPU untouched pages stay uncommitted until a
        # slot is written. Only the dummy slot can be read before it is
        # written (padded decode entries), so only it is zeroed: garbage
        # there could be NaN, and 0 * NaN survives the attention mask.
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k_buffer + self.v_buffer:
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V ([T, kv_heads, head_dim]) into their slots."""
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (int64, on
        the pool's device; no slot in both). The rows of a cached page that
        a request's prefix match ends inside, copied into its own page."""
        for buf in self.k_buffer + self.v_buffer:
            buf.index_copy_(0, dst, buf.index_select(0, src))


class ReqToTokenTable:
    """`table[row, pos]` = KV slot of token `pos` of the request in `row`.

    Shape `[max_running_requests + 1, context_len]`, int32; row 0 is unused.
    """

    def __init__(self, num_rows: int, context_len: int, device: str | torch.device) -> None:
        self.table = torch.zeros((num_rows + 1, context_len), dtype=torch.int32, device=device)

    @property
    def context_len(self) -> int:
        return self.table.shape[1]


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/meminfo")


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can give without swapping)."""
    return _meminfo_bytes("MemAvailable")


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of the device: a GPU's, or this machine's RAM."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))
    return mem_available_bytes(), _meminfo_bytes("MemTotal")


def kv_budget_bytes(server_args: ServerArgs, weight_bytes: int) -> int:
    """Bytes the KV pool may take, decided before the weights reach the device.

    --mem-fraction-static f (SGLang's meaning): weights and KV cache together
    take at most f of the device's total memory, next to what is already used
    there, so KV = f x total - used - weights; the rest (1 - f) is left for
    activations and everything else. Without the flag a GPU takes f = 0.88
    (SGLang's default for large GPUs) and a CPU a quarter of the available
    RAM, since the machine runs other things too."""
    fraction = server_args.mem_fraction_static
    is_cuda = torch.device(server_args.device).type == "cuda"
    if fraction is None and not is_cuda:
        return int(mem_available_bytes() * CPU_KV_FRACTION)
    free, total = device_memory(server_args.device)
    fraction = GPU_MEM_FRACTION_STATIC if fraction is None else fraction
    return int(fraction * total - (total - free) - weight_bytes)


def kv_pool_size(server_args: ServerArgs, context_len: int, bytes_per_token: int,
                 weight_bytes: int = 0) -> int:
    """Tokens the pool holds: the flag if given, else what the budget affords,
    never more than every running request at full context could use."""
    if server_args.max_total_tokens is not None:
        return server_args.max_total_tokens
    ceiling = server_args.max_running_requests * context_len
    afford = kv_budget_bytes(server_args, weight_bytes) // bytes_per_token
    if afford < 1:
        raise RuntimeError(
            "no memory left for the KV cache once the weights are loaded: raise --mem-fraction-static "
            f"({server_args.mem_fraction_static}) or pass --max-total-tokens")
    return max(1, min(ceiling, afford))
