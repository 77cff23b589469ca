"""Where a benchmark's rows keep their KV: pages of the pool, drawn at random.

The server's allocator (scheduler_proc/memory.py) hands out pages of
`--page-size` slots, and a request fills its own pages in order; after some
churn its pages lie anywhere in the pool. A benchmark that fills the table
by hand lays rows out the same way: each row on pages drawn at random (a
permutation of the pool's pages), filled in order. Page size 1 is a slot per
token, every token on a slot of its own drawn at random.
"""

from __future__ import annotations

import torch

from common.server_args import ServerArgs

SERVER_PAGE_SIZE: int = ServerArgs.__dataclass_fields__["page_size"].default  # the server's --page-size


def scattered_pages(rows: int, context: int, pool_slots: int, page_size: int,
                    gen: torch.Generator) -> torch.Tensor:
    """[rows, context] int32 slots (1..pool_slots): row r's j-th page is
    perm[(r * pages_per_row + j) % pages], so rows share pages only when the
    pool holds fewer pages than they need."""
    per_row = -(-context // page_size)
    pages = pool_slots // page_size
    perm = torch.randperm(pages, generator=gen)
    first = perm[torch.arange(rows * per_row) % pages].view(rows, per_row) * page_size + 1
    slots = (first.unsqueeze(-1) + torch.arange(page_size)).view(rows, -1)[:, :context]
    return slots.to(torch.int32)
