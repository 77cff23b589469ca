"""bench/lib/kv_layout.py: the benches lay rows out as the server's allocator does."""

from __future__ import annotations

import torch

from bench.lib.kv_layout import scattered_pages


def test_rows_sit_on_whole_pages_filled_in_order_and_drawn_at_random():
    slots = scattered_pages(rows=3, context=10, pool_slots=64, page_size=4, gen=torch.Generator().manual_seed(0))
    assert slots.shape == (3, 10) and slots.dtype == torch.int32
    firsts = slots[:, ::4]
    assert bool(((firsts - 1) % 4 == 0).all())  # each page starts on a page boundary
    inner = [j for j in range(10) if j % 4]
    assert bool((slots[:, inner] == slots[:, [j - 1 for j in inner]] + 1).all())  # and is filled in order
    pages = ((firsts - 1) // 4).flatten().tolist()
    assert len(set(pages)) == len(pages) and pages != sorted(pages)  # distinct pages, not in pool order
    assert int(slots.min()) >= 1 and int(slots.max()) <= 64


def test_rows_share_pages_only_when_the_pool_is_short_and_page_one_is_a_slot_per_token():
    short = scattered_pages(rows=4, context=8, pool_slots=16, page_size=4, gen=torch.Generator().manual_seed(1))
    assert set(((short[:, ::4] - 1) // 4).flatten().tolist()) == {0, 1, 2, 3}  # 8 pages' worth on 4
    single = scattered_pages(rows=2, context=5, pool_slots=10, page_size=1, gen=torch.Generator().manual_seed(2))
    assert sorted(single.flatten().tolist()) == list(range(1, 11))
