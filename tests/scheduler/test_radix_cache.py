"""The radix tree alone: matching, splitting, insertion, locks and LRU eviction."""

from __future__ import annotations

import random

import pytest
import numpy as np

from scheduler_proc.radix_cache import RadixCache


def slots(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


class FreeList:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def __call__(self, t: np.ndarray) -> None:
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


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_inserts_matches_locks_and_evictions_keep_the_accounts(page_size):
    """Property: a match is a prefix the tree holds (whole pages shared, then
    rows of the next page to copy), every slot it names holds the token at
    its position of that very prefix, sizes always add up (a partial leaf
    holds its whole page), and every page inserted is freed exactly once
    between eviction, a superseded partial leaf and reset; with a slot per
    token, and pages of two and four, keys ending inside a page included."""
    P = page_size
    for seed in range(20):
        rng = random.Random(seed)
        freed_pages: list[int] = []  # as the allocator frees: a page per page_size-th slot
        tree = RadixCache(lambda t: freed_pages.extend(((t[::P] - 1) // P).tolist()), page_size)
        next_page = 0
        owned: set[int] = set()  # pages the tree took
        holds: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose last token it holds
        locks = []
        for _ in range(200):
            op = rng.random()
            key = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
            if op < 0.45:
                new = slots(*range(1 + next_page * P, 1 + next_page * P + len(key)))
                next_page += -(-len(key) // P)
                for i, s in enumerate(new.tolist()):
                    holds[s] = tuple(key[:i + 1])
                had = tree.insert(key, new)
                assert had == len(key) or had % P == 0
                owned.update((s - 1) // P for s in new[had:].tolist())
            elif op < 0.7:
                m = tree.match_prefix(key)
                assert m.slots.size % P == 0 and m.copy_slots.size < P
                assert m.copy_node is None or m.copy_node.parent is m.node
                for i, s in enumerate(m.slots.tolist() + m.copy_slots.tolist()):
                    assert holds[s] == tuple(key[:i + 1])
                assert m.length <= len(key)
                if rng.random() < 0.5:
                    tree.lock(m.copy_node or m.node)
                    locks.append(m.copy_node or m.node)
            elif op < 0.85 and locks:
                tree.unlock(locks.pop(rng.randrange(len(locks))))
            else:
                tree.evict(rng.randint(1, 10))
            assert tree.check() is None
            assert len(set(freed_pages)) == len(freed_pages), "a page freed twice"
            assert tree.total_size // P + len(freed_pages) == len(owned)
        for node in locks:
            tree.unlock(node)
        tree.reset()
        assert sorted(freed_pages) == sorted(owned)


# ---- pages of several tokens ------------------------------------------------------------

def test_with_pages_shared_pages_end_at_a_page_boundary_and_the_next_rows_are_named_for_a_copy():
    tree = RadixCache(FreeList(), page_size=2)
    assert tree.insert([1, 2, 3, 4, 5, 6], slots(11, 12, 13, 14, 15, 16)) == 0
    m = tree.match_prefix([1, 2, 3, 9, 5, 6])  # diverges inside the second page
    assert m.slots.tolist() == [11, 12] and m.node.key == [1, 2]
    assert m.copy_slots.tolist() == [13] and m.copy_node.key == [3, 4] and m.length == 3  # cut: its page alone is locked
    m = tree.match_prefix([1, 2, 3, 4, 5])  # ends inside the last page
    assert m.slots.tolist() == [11, 12, 13, 14] and m.copy_slots.tolist() == [15] and m.length == 5
    m = tree.match_prefix([1])
    assert m.slots.size == 0 and m.copy_slots.tolist() == [11] and m.copy_node.key == [1, 2]
    assert tree.match_prefix([2]).length == 0
    assert tree.check() is None


def test_with_pages_children_that_share_a_first_token_are_told_apart_by_their_first_page():
    tree = RadixCache(FreeList(), page_size=2)
    tree.insert([1, 2, 3, 4], slots(11, 12, 13, 14))
    assert tree.insert([1, 5, 6, 7], slots(21, 22, 23, 24)) == 0  # no whole page in common
    assert tree.match_prefix([1, 5, 6, 7]).slots.tolist() == [21, 22, 23, 24]
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 14]
    assert tree.evictable_size == 8 and tree.check() is None


def test_with_pages_a_partial_last_page_goes_in_whole_and_eviction_frees_pages_whole():
    freed = FreeList()
    tree = RadixCache(freed, page_size=4)
    assert tree.insert([1, 2, 3], slots(1, 2, 3)) == 0  # a partial leaf: it holds the whole page
    assert tree.evictable_size == 4 and tree.check() is None
    tree.insert(list(range(8)), slots(*range(5, 13)))
    tree.insert(list(range(4)) + [9, 9, 9, 9], slots(*range(5, 9), *range(21, 25)))
    assert tree.evict(1) == 4 and len(freed.freed) in (3, 4)  # one leaf: a whole page
    assert tree.check() is None


def test_a_partial_leaf_is_matched_for_a_copy_and_superseded_by_a_longer_key():
    freed = FreeList()
    tree = RadixCache(freed, page_size=4)
    tree.insert([1, 2, 3, 4, 5, 6], slots(1, 2, 3, 4, 5, 6))  # a page and 2 rows of the next
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.slots.tolist() == [1, 2, 3, 4] and m.copy_slots.tolist() == [5, 6]
    partial = m.copy_node
    assert partial.key == [5, 6] and tree.evictable_size == 8
    # fewer rows than the partial leaf holds: all there already, nothing new
    assert tree.insert([1, 2, 3, 4, 5], slots(1, 2, 3, 4, 31)) == 5
    # a key that extends it: its own page holds the same rows, the partial leaf goes
    assert tree.insert([1, 2, 3, 4, 5, 6, 7], slots(1, 2, 3, 4, 41, 42, 43)) == 4
    assert freed.freed == [5, 6]
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.copy_slots.tolist() == [41, 42, 43] and tree.evictable_size == 8 and tree.check() is None
    # a held partial leaf stays when superseded (a copy from it is not sent yet)
    tree.lock(m.copy_node)
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], slots(1, 2, 3, 4, 51, 52, 53, 54, 55)) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).length == 9
    assert tree.protected_size == 8 and tree.evictable_size == 8 and tree.check() is None  # [5..9]: 2 pages
    tree.unlock(m.copy_node)
    # a partial leaf that a longer whole-page key runs through is cut at its page
    tree.reset()
    tree.insert([1, 2, 3, 4, 5, 6], slots(1, 2, 3, 4, 5, 6))
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8], slots(1, 2, 3, 4, 61, 62, 63, 64)) == 4
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).slots.tolist() == [1, 2, 3, 4, 61, 62, 63, 64]
    assert tree.num_nodes() == 2 and tree.check() is None
