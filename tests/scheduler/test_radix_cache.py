"""The radix tree alone: matching, splitting, insertion, locks and LRU eviction."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_proc.radix_cache import RadixCache


def slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class FreeList:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def __call__(self, t: torch.Tensor) -> None:
        self.freed.extend(t.tolist())


def test_match_returns_the_longest_cached_prefix_and_splits_inside_a_node():
    tree = RadixCache(FreeList())
    assert tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14)) == 0
    m = tree.match_prefix([1, 2, 9])
    assert m.slots.tolist() == [11, 12] and m.length == 2
    assert m.node.key == [1, 2]  # the node was split where the match ended
    assert [c.key for c in m.node.children.values()] == [[3, 4]]
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]
    assert tree.match_prefix([7]).length == 0
    assert tree.evictable_size == 4 and tree.check() is None


def test_insert_reports_what_was_already_cached():
    tree = RadixCache(FreeList())
    tree.insert([1, 2, 3], slots(11, 12, 13))
    # [1, 2] are cached already: the caller's slots 21, 22 are duplicates
    assert tree.insert([1, 2, 5, 6], slots(21, 22, 23, 24)) == 2
    assert tree.match_prefix([1, 2, 5, 6]).slots.tolist() == [11, 12, 23, 24]
    assert tree.insert([1, 2, 3], slots(31, 32, 33)) == 3  # all there
    assert tree.evictable_size == 5 and tree.num_nodes() == 3 and tree.check() is None


def test_locks_protect_the_whole_path_and_unlock_makes_it_evictable_again():
    tree = RadixCache(FreeList())
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    tree.insert([1, 2, 5], slots(21, 22, 25))
    m = tree.match_prefix([1, 2, 3, 4])
    assert tree.evictable_on_path(m.node) == 4
    tree.lock(m.node)
    assert (tree.protected_size, tree.evictable_size) == (4, 1)
    assert tree.evictable_on_path(m.node) == 0
    other = tree.match_prefix([1, 2, 5])
    assert tree.evictable_on_path(other.node) == 1  # [1, 2] is already protected
    tree.lock(other.node)
    tree.unlock(m.node)
    assert (tree.protected_size, tree.evictable_size) == (3, 2)
    tree.unlock(other.node)
    assert (tree.protected_size, tree.evictable_size) == (0, 5) and tree.check() is None


def test_eviction_frees_least_recently_used_unlocked_leaves_and_cascades_to_parents():
    freed = FreeList()
    tree = RadixCache(freed)
    tree.insert([1, 2, 3], slots(11, 12, 13))
    tree.insert([1, 2, 4], slots(11, 12, 14))  # shares [1, 2]
    tree.insert([7, 8], slots(17, 18))
    tree.match_prefix([1, 2, 3])  # [1, 2, 3] used most recently
    locked = tree.match_prefix([7, 8]).node
    tree.lock(locked)
    assert tree.evict(1) == 1 and freed.freed == [14]  # the LRU unlocked leaf
    assert tree.evict(10) == 3 and sorted(freed.freed) == [11, 12, 13, 14]  # [3], then its parent
    assert tree.evictable_size == 0 and tree.protected_size == 2  # the locked path stays
    assert tree.match_prefix([7, 8]).length == 2 and tree.check() is None


def test_salts_never_share_a_prefix():
    tree = RadixCache(FreeList())
    tree.insert([1, 2, 3], slots(11, 12, 13), salt="tenant-a")
    assert tree.match_prefix([1, 2, 3], salt="tenant-b").length == 0
    assert tree.match_prefix([1, 2, 3]).length == 0  # no salt is a salt of its own
    assert tree.match_prefix([1, 2, 3], salt="tenant-a").length == 3
    assert tree.insert([1, 2, 3], slots(21, 22, 23), salt="tenant-b") == 0
    assert tree.evictable_size == 6 and tree.evict(6) == 6 and tree.check() is None


def test_reset_frees_every_slot():
    freed = FreeList()
    tree = RadixCache(freed)
    tree.insert([1, 2, 3], slots(11, 12, 13))
    tree.insert([1, 5], slots(11, 15))
    tree.reset()
    assert sorted(freed.freed) == [11, 12, 13, 15]
    assert tree.total_size == 0 and tree.num_nodes() == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_random_inserts_matches_locks_and_evictions_keep_the_accounts(page_size):
    """Property: a match is a prefix the tree holds in whole pages, sizes
    always add up, and every slot inserted is freed exactly once between
    eviction and reset; with a slot per token and with pages of two."""
    for seed in range(20):
        rng = random.Random(seed)
        freed = FreeList()
        tree = RadixCache(freed, page_size)
        next_slot = 1
        owned: set[int] = set()  # slots the tree took
        locks = []
        for _ in range(200):
            op = rng.random()
            key = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
            if op < 0.45:
                key = key[:len(key) - len(key) % page_size] or [0] * page_size
                new = slots(*range(next_slot, next_slot + len(key)))
                next_slot += len(key)
                had = tree.insert(key, new)
                owned.update(new[had:].tolist())
            elif op < 0.7:
                m = tree.match_prefix(key)
                assert m.length % page_size == 0
                assert m.slots.tolist() == tree.match_prefix(key[:m.length]).slots.tolist()
                if rng.random() < 0.5:
                    tree.lock(m.node)
                    locks.append(m.node)
            elif op < 0.85 and locks:
                tree.unlock(locks.pop(rng.randrange(len(locks))))
            else:
                tree.evict(rng.randint(1, 10))
            assert tree.check() is None
            assert tree.total_size + len(freed.freed) == len(owned)
        for node in locks:
            tree.unlock(node)
        tree.reset()
        assert sorted(freed.freed) == sorted(owned)


# ---- pages of several tokens ------------------------------------------------------------

def test_with_pages_a_match_and_a_split_stop_at_a_page_boundary():
    tree = RadixCache(FreeList(), page_size=2)
    assert tree.insert([1, 2, 3, 4, 5, 6], slots(11, 12, 13, 14, 15, 16)) == 0
    m = tree.match_prefix([1, 2, 3, 9, 5, 6])  # diverges inside the second page
    assert m.slots.tolist() == [11, 12] and m.node.key == [1, 2]
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]  # a partial last page is not matched
    assert tree.match_prefix([1]).length == 0
    assert tree.check() is None


def test_with_pages_children_that_share_a_first_token_are_told_apart_by_their_first_page():
    tree = RadixCache(FreeList(), page_size=2)
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    assert tree.insert([1, 5, 6, 7], slots(21, 22, 23, 24)) == 0  # no whole page in common
    assert tree.match_prefix([1, 5, 6, 7]).slots.tolist() == [21, 22, 23, 24]
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 14]
    assert tree.evictable_size == 8 and tree.check() is None


def test_with_pages_only_whole_pages_go_in_and_eviction_frees_them_whole():
    freed = FreeList()
    tree = RadixCache(freed, page_size=4)
    with pytest.raises(AssertionError):
        tree.insert([1, 2, 3], slots(1, 2, 3))  # not whole pages
    tree.insert(list(range(8)), slots(*range(5, 13)))
    tree.insert(list(range(4)) + [9, 9, 9, 9], slots(*range(5, 9), *range(21, 25)))
    assert tree.evict(1) == 4 and len(freed.freed) == 4  # one leaf: a whole page
    assert tree.check() is None
