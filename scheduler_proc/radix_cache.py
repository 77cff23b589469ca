"""The radix tree of cached prefixes: token ids -> the KV slots that hold them.

A node's `key` is a run of token ids and its `value` the KV slots of those
tokens, at the positions the path from the root gives them. A request that
shares a prefix with an earlier one matches the longest path of that prefix
and reuses its slots instead of recomputing them.

Slots in the tree are either protected (some running request holds a lock on
a node at or below them) or evictable (no lock): eviction frees unlocked
leaves, least recently used first, and a parent left childless and unlocked
becomes a leaf in turn. The tree only keeps accounts; freeing a slot is the
caller's (`free_slots`), so one class (CacheManager) owns the slot lifecycle.

Requests with different `cache_salt` never share a node: each salt has a
root of its own.

With pages of several tokens (`page_size`, the allocator's) keys are walked
and cut at page boundaries, a node's children are told apart by their first
page, and eviction frees whole pages. A leaf may end inside its last page (a
finished request's last, partly filled page: the tokens it holds). A match
walks whole pages and then may go on inside the next page: those rows (fewer
than a page) cannot be shared in place, since a request writes its next
tokens into the rest of that page, so the match names them (`copy_slots`,
in `copy_node`) for the caller to copy into a page of the request's own.
Such a partial leaf is superseded, and dropped if no one holds it, when a
key that extends it goes in: the new key's own page holds the same rows.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from scheduler_proc.memory import Slots

_clock = itertools.count()  # LRU order: a counter, not wall time (ties are impossible)


@dataclass(eq=False)
class TreeNode:
    key: list[int]
    value: Slots  # int64 KV slots, one per key token
    parent: "TreeNode | None"
    children: dict[int | tuple[int, ...], "TreeNode"] = field(default_factory=dict)  # by first page
    lock_ref: int = 0  # running requests whose matched path goes through here
    last_access: int = field(default_factory=lambda: next(_clock))

    def __len__(self) -> int:
        return len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class PrefixMatch:
    """The longest cached prefix of a key: the slots of its whole pages, and
    the deepest node they end on (lock it to keep the whole path in the tree);
    then the rows the tree holds inside the next page (`copy_slots`, fewer
    than a page, the first rows of `copy_node`, a child of `node`), which a
    request can only take as a copy."""

    slots: Slots
    node: TreeNode
    copy_slots: Slots = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    copy_node: TreeNode | None = None

    @property
    def length(self) -> int:
        """Tokens matched: the shared pages' and the rows to copy."""
        return self.slots.size + self.copy_slots.size

    def without_copy(self) -> "PrefixMatch":
        """The shared pages alone (when the copy's page does not fit)."""
        return PrefixMatch(slots=self.slots, node=self.node)


def _shared_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, free_slots: Callable[[Slots], None], page_size: int = 1) -> None:
        self.free_slots = free_slots
        self.page_size = page_size
        self.roots: dict[str, TreeNode] = {}
        self.evictable_size = 0  # slots in nodes no request locks
        self.protected_size = 0  # slots in locked nodes

    def root(self, salt: str) -> TreeNode:
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = TreeNode(key=[], value=np.empty(0, dtype=np.int64),
                                               parent=None, lock_ref=1)  # a root never leaves
        return node

    def _child_key(self, key: list[int], pos: int = 0) -> int | tuple[int, ...]:
        """What tells a node's children apart: their first token, or first page."""
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _whole_pages(self, n: int) -> int:
        return n - n % self.page_size

    def _slots(self, node: TreeNode) -> int:
        """Slots a node holds: whole pages (a partial leaf holds all of its last page)."""
        return -(-len(node) // self.page_size) * self.page_size

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookup and insertion -----------------------------------------------------------

    def match_prefix(self, key: list[int], salt: str = "") -> PrefixMatch:
        """The longest prefix of `key` in the tree: whole pages along the path,
        then, with pages of several tokens, the rows of the next page that a
        child holds (to copy; see PrefixMatch). A match that ends inside a
        node at a page boundary splits it, so the shared pages end on a node."""
        node = self.root(salt)
        parts: list[Slots] = []
        pos = 0
        whole = self._whole_pages(len(key))
        while pos < whole:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._whole_pages(_shared_len(child.key, key[pos:whole]))
            if n < len(child):
                child = self._split(child, n)
            child.last_access = next(_clock)
            parts.append(child.value)
            node = child
            pos += n
        slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        match = PrefixMatch(slots=slots, node=node)
        if self.page_size > 1 and pos < len(key):
            rest = key[pos:pos + self.page_size]
            best, k = None, 0
            for child in node.children.values():
                if child.key[0] != rest[0]:
                    continue
                n = _shared_len(child.key[:len(rest)], rest)
                if n > k:
                    best, k = child, n
            if best is not None:
                if len(best) > self.page_size:  # lock no more than the page copied from
                    best = self._split(best, self.page_size)
                best.last_access = next(_clock)
                match.copy_node, match.copy_slots = best, best.value[:k]
        return match

    def insert(self, key: list[int], slots: Slots, salt: str = "") -> int:
        """Add `key` with its `slots`. Returns how many leading tokens were in
        the tree already: their slots in `slots` are duplicates that the caller
        still owns (and frees); the rest now belong to the tree (evictable).
        `key` starts on a page boundary; it may end inside a page (a finished
        request's last page), which then goes in as a partial leaf, unless a
        node already holds those rows (then all of it was there already)."""
        assert len(key) == slots.size
        P = self.page_size
        node = self.root(salt)
        pos = 0
        while pos < len(key):
            rest = key[pos:]
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                if len(rest) < P and self._holding(node, rest) is not None:
                    return len(key)
                self._drop_superseded(node, rest)
                new = TreeNode(key=list(rest), value=slots[pos:].copy(), parent=node)
                node.children[self._child_key(key, pos)] = new
                self.evictable_size += self._slots(new)
                return pos
            n = _shared_len(child.key, rest)
            child.last_access = next(_clock)
            if n == len(rest):  # the key ends inside child (or at its end): all of it is there
                if n < len(child) and n % P == 0:
                    self._split(child, n)
                return len(key)
            if n >= len(child) and len(child) % P == 0:
                node, pos = child, pos + len(child)
                continue
            # the key leaves child inside it, or goes past a partial leaf: cut
            # child at the last whole page both hold, and go on from there
            n = self._whole_pages(min(n, len(child)))
            node, pos = self._split(child, n), pos + n
        return pos

    def _holding(self, node: TreeNode, rows: list[int]) -> TreeNode | None:
        """A child of `node` whose first rows are `rows` (fewer than a page)."""
        for child in node.children.values():
            if child.key[0] == rows[0] and child.key[:len(rows)] == rows:
                child.last_access = next(_clock)
                return child
        return None

    def _drop_superseded(self, node: TreeNode, rest: list[int]) -> None:
        """Partial leaves under `node` (less than a page) whose rows start
        `rest`, which goes in now with its own page holding the same rows: no
        match needs them any more. One that a request holds (a copy not yet
        sent) stays, to be evicted later like any leaf."""
        for first, child in list(node.children.items()):
            if len(child) < self.page_size and len(child) < len(rest) and child.key[0] == rest[0] \
                    and child.lock_ref == 0 and not child.children and rest[:len(child)] == child.key:
                self.free_slots(child.value)
                self.evictable_size -= self._slots(child)
                del node.children[first]

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens (whole pages); returns the new upper part.
        Locks are per path, so the upper part inherits the child's count."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child) and n % self.page_size == 0
        upper = TreeNode(key=child.key[:n], value=child.value[:n], parent=parent,
                         lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[self._child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---- locks ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (a request uses it)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= self._slots(node)
                self.protected_size += self._slots(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while not node.is_root:
            assert node.lock_ref > 0, "unlock without a lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= self._slots(node)
                self.evictable_size += self._slots(node)
            node = node.parent  # type: ignore[assignment]

    def evictable_on_path(self, node: TreeNode) -> int:
        """Slots that locking `node` would move from evictable to protected."""
        n = 0
        while not node.is_root:
            if node.lock_ref == 0:
                n += self._slots(node)
            node = node.parent  # type: ignore[assignment]
        return n

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_slots: int, until: Callable[[], bool] | None = None) -> int:
        """Free at least `num_slots` slots (fewer if not that many are
        evictable), least recently used leaves first, and go on until
        `until()` holds if given (the caller's other pool has room). Returns
        slots freed."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while (freed < num_slots or (until is not None and not until())) and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            self.free_slots(node.value)
            freed += self._slots(node)
            self.evictable_size -= self._slots(node)
            del parent.children[self._child_key(node.key)]
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def unlocked_nodes(self) -> list[TreeNode]:
        """The nodes eviction could free (no request locks them)."""
        return [n for n in self._nodes() if n.lock_ref == 0]

    def reset(self) -> None:
        """Drop every node (the caller checked that nothing is locked)."""
        assert self.protected_size == 0, "reset with locked nodes"
        for node in self._nodes():
            self.free_slots(node.value)
        self.roots.clear()
        self.evictable_size = 0

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check(self) -> str | None:
        """Recount sizes and locks from the nodes; a description of the first
        mismatch, or None."""
        evictable = protected = 0
        for node in self._nodes():
            if len(node) == 0 or len(node) != node.value.size or (len(node) % self.page_size and node.children):
                return f"node with key length {len(node)} and {node.value.size} slots (page {self.page_size})"
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                return "a node holds fewer locks than its children"
            if node.lock_ref:
                protected += self._slots(node)
            else:
                evictable += self._slots(node)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            return (f"counted evictable {evictable} / protected {protected}, recorded "
                    f"{self.evictable_size} / {self.protected_size}")
        return None

    def num_nodes(self) -> int:
        return len(self._nodes())
