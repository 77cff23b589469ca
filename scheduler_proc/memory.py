"""Scheduler-side memory bookkeeping: which KV slots and which table rows are free.

The model process holds the KV tensors and its own copy of `req_to_token`; the
scheduler decides which slots every token gets and keeps a mirror of the table
so it can free a request's slots without asking the model.
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slot indices 1..size; slot 0 is the dummy target for padding.

    Alloc and free are tensor slices and concatenations, never per-token loops.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)

    def available(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.free_slots = torch.cat([self.free_slots, slots.to(torch.int64)])


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
