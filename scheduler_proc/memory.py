"""Scheduler-side memory bookkeeping: which KV slots and which table rows are free.

The model process holds the KV tensors and its own copy of `req_to_token`; the
scheduler decides which slots every token gets and keeps a mirror of the table
so it can free a request's slots without asking the model.
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slot indices 1..size; slot 0 is the dummy target for padding.

    A stack in one preallocated tensor: alloc takes the top n, free pushes
    back, each a slice copy costing the slots moved, never the pool."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.stack = torch.arange(1, size + 1, dtype=torch.int64)
        self.num_free = size

    def available(self) -> int:
        return self.num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.num_free:
            return None
        self.num_free -= n
        return self.stack[self.num_free:self.num_free + n].clone()  # frees overwrite the stack

    def free(self, slots: torch.Tensor) -> None:
        k = slots.numel()
        if k:
            assert self.num_free + k <= self.size, "more slots freed than the pool holds"
            self.stack[self.num_free:self.num_free + k] = slots.to(torch.int64)
            self.num_free += k


class ReqToTokenPool:
    """Rows of the `req_to_token` table: row r, column p holds the KV slot of
    token p of the request resident in row r. Row 0 is never handed out."""

    def __init__(self, num_rows: int, context_len: int) -> None:
        self.num_rows = num_rows
        self.req_to_token = torch.zeros(num_rows + 1, context_len, dtype=torch.int32)
        self.free_rows: list[int] = list(range(1, num_rows + 1))

    def available(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)
