"""KV storage on the model side: the per-layer K/V slot buffers and the
`req_to_token` table that maps (request row, position) to a slot.

The scheduler owns which slots and rows are free; this module only stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from common.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.25  # of MemAvailable, when neither --max-total-tokens nor --mem-fraction-static is given
GPU_MEM_FRACTION_STATIC = 0.88  # weights + KV share of a GPU's memory, when not given


class KVPool:
    """Per layer `k_buffer[l]`, `v_buffer[l]`: `[size + 1, num_kv_heads, head_dim]`.

    Slot 0 is the dummy target for padded tokens, so real slots are 1..size.

    `int8` (--kv-cache-dtype int8): the buffers hold int8, and `k_scale[l]`,
    `v_scale[l]` [size + 1, num_kv_heads] float32 one scale per token and
    head: a stored row x becomes round(x / s) with s = max |x| / 127 (half
    the bytes of bfloat16, a quarter of float32's, plus 4 bytes per head
    and token for the scale). `gather` reads rows back in `dtype`; the
    native decode op reads the int8 rows and scales in place.

    With a window pool (`windowed` layers, `window_size` > 0; see
    scheduler_proc/window_pool.py) a sliding layer's buffers hold
    `window_size + 1` slots instead, and the step's slots (the full pool's
    numbering, which req_to_token holds) reach them through `window_slot`,
    the pairing of full pages with window pages that the scheduler sends
    (ForwardBatch.window_pages, applied by `pair_pages`).
    """

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device, *, windowed: Sequence[bool] = (),
                 window_size: int = 0, page_size: int = 1, int8: bool = False) -> None:
        self.size = size
        self.dtype = dtype  # what attention computes in, and what `gather` returns
        self.int8 = int8
        self.num_layers = num_layers
        self.page_size = page_size
        self.window_size = window_size if any(windowed) else 0
        self.windowed = [bool(w) and self.window_size > 0 for w in windowed] or [False] * num_layers
        # empty, not zeros: on CPU untouched pages stay uncommitted until a
        # slot is written. Only the dummy slot can be read before it is
        # written (padded decode entries), so only it is zeroed: garbage
        # there could be NaN, and 0 * NaN survives the attention mask. Every
        # backend reads a sliding layer's keys inside the window of its
        # first query only, which the scheduler keeps paired and written.
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # int8 only
        self.v_scale: list[torch.Tensor] = []
        for w in self.windowed:
            shape = ((self.window_size if w else size) + 1, num_kv_heads, head_dim)
            self.k_buffer.append(torch.empty(shape, dtype=torch.int8 if int8 else dtype, device=device))
            self.v_buffer.append(torch.empty(shape, dtype=torch.int8 if int8 else dtype, device=device))
            if int8:
                self.k_scale.append(torch.empty(shape[:2], dtype=torch.float32, device=device))
                self.v_scale.append(torch.empty(shape[:2], dtype=torch.float32, device=device))
        for buf in self.k_buffer + self.v_buffer + self.k_scale + self.v_scale:
            buf[0].zero_()
        # full slot -> window slot (0, the dummy, until its page is paired)
        self.window_slot = torch.zeros(size + 1, dtype=torch.int64, device=device) if self.window_size else None

    def to_window(self, slots: torch.Tensor) -> torch.Tensor:
        """Full-pool slots as a sliding layer's buffers number them."""
        assert self.window_slot is not None
        return self.window_slot[slots]

    def pair_pages(self, pairs: list[int]) -> None:
        """Apply ForwardBatch.window_pages: (full page, window page) pairs,
        flattened, in the order made (a later pair of a page replaces it)."""
        assert self.window_slot is not None
        last = dict(zip(pairs[::2], pairs[1::2]))
        dev, P = self.window_slot.device, self.page_size
        full = torch.tensor(list(last.keys()), dtype=torch.int64, device=dev)[:, None]
        win = torch.tensor(list(last.values()), dtype=torch.int64, device=dev)[:, None]
        offsets = torch.arange(1, P + 1, device=dev)
        self.window_slot[(full * P + offsets).view(-1)] = (win * P + offsets).view(-1)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        int8: bool = False) -> int:
        per_head = head_dim + 4 if int8 else head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * per_head

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer + self.k_scale + self.v_scale)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V ([T, kv_heads, head_dim]) into their
        slots (the layer's numbering: AttentionBackend.layer_slots)."""
        if self.int8:
            for x, buf, scale in ((k, self.k_buffer[layer_id], self.k_scale[layer_id]),
                                  (v, self.v_buffer[layer_id], self.v_scale[layer_id])):
                q, s = quantize_rows(x)
                buf.index_copy_(0, loc, q)
                scale.index_copy_(0, loc, s)
            return
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)

    def gather(self, layer_id: int, slots: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """K/V of `slots` (the layer's numbering) into k_out, v_out [len(slots),
        kv_heads, head_dim] of `dtype`: an int8 pool's rows times their scales."""
        if not self.int8:
            torch.index_select(self.k_buffer[layer_id], 0, slots, out=k_out)
            torch.index_select(self.v_buffer[layer_id], 0, slots, out=v_out)
            return
        for buf, scale, out in ((self.k_buffer[layer_id], self.k_scale[layer_id], k_out),
                                (self.v_buffer[layer_id], self.v_scale[layer_id], v_out)):
            torch.mul(buf.index_select(0, slots), scale.index_select(0, slots)[..., None], out=out)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (int64, on
        the pool's device; no slot in both). The rows of a cached page that
        a request's prefix match ends inside, copied into its own page."""
        for layer, windowed in enumerate(self.windowed):
            s, d = (self.to_window(src), self.to_window(dst)) if windowed else (src, dst)
            scales = (self.k_scale[layer], self.v_scale[layer]) if self.int8 else ()
            for buf in (self.k_buffer[layer], self.v_buffer[layer], *scales):
                buf.index_copy_(0, d, buf.index_select(0, s))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, heads, D] -> (int8 [T, heads, D], float32 scales [T, heads]):
    each head row rounded half to even to x / s, s = max |x| / 127 (0 for an
    all-zero row), in float32: the native op's store
    (model_proc/native/attention.cpp store_kv_int8) gives the same bits."""
    x = x.float()
    s = x.abs().amax(-1) / 127
    q = torch.where(s[..., None] > 0, torch.round(x / s[..., None]), 0.0).clamp_(-127, 127)
    return q.to(torch.int8), s


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


def window_pool_size(server_args: ServerArgs, full_tokens: int, window: int) -> int:
    """Slots of the sliding layers' pool: --swa-full-tokens-ratio of the full
    pool's, but at least what every running request's window needs (a page
    either side of it) plus a prefill step's tokens, and at most the full
    pool's; whole pages."""
    P = server_args.page_size
    step = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 \
        else server_args.max_prefill_tokens
    floor = server_args.max_running_requests * (window + 2 * P) + step + 2 * P
    size = min(full_tokens, max(int(server_args.swa_full_tokens_ratio * full_tokens), floor))
    return max(P, size // P * P)


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
