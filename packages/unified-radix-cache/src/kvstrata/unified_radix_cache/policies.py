"""Eviction policies and the heap of evictable leaves they order.

A policy maps a node to a sort key; the smallest key is evicted first. The tree keeps only
unlocked childless nodes in a `LeafHeap`, updated incrementally (a node joins when its last child
goes and it is unlocked, leaves when it is locked or given a child), so evicting k leaves costs
O(k log n) and never walks the tree.

Times are the tree's logical clock (one tick per match or insert), so eviction order is exact and
reproducible; ties break by node id (creation order).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from kvstrata.unified_radix_cache.errors import IntegrityError, InvalidConfig
from kvstrata.unified_radix_cache.node import HeapEntry, TreeNode


class EvictionPolicy(ABC):
    """Orders evictable leaves: `key(node)` smallest goes first. Stateless."""

    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def key(node: TreeNode) -> tuple[int, int]:
        """Sort key of `node` under this policy (read at push time)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (node.last_access, 0)


class LFUPolicy(EvictionPolicy):
    """Fewest hits first, then least recently used."""

    name = "lfu"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (node.hit_count, node.last_access)


class FIFOPolicy(EvictionPolicy):
    """Oldest node first (creation time)."""

    name = "fifo"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (node.created, 0)


class MRUPolicy(EvictionPolicy):
    """Most recently used first."""

    name = "mru"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (-node.last_access, 0)


class FILOPolicy(EvictionPolicy):
    """Newest node first (creation time)."""

    name = "filo"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (-node.created, 0)


class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first (a node carries the max priority of the requests that
    inserted through it, so a parent is never below its descendants), then least recently used."""

    name = "priority"

    @staticmethod
    def key(node: TreeNode) -> tuple[int, int]:
        return (node.priority, node.last_access)


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, MRUPolicy, FILOPolicy, PriorityPolicy)
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name` (lru, lfu, fifo, mru, filo, priority)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidConfig(
            f"unknown eviction policy {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None


class LeafHeap:
    """Min-heap of evictable leaves with lazy invalidation.

    A node is in the set iff it is in `_members` (node id -> node); its current entry is
    `node.heap_entry`. The heap may also hold stale entries (of nodes re-pushed with a new key,
    or removed), recognised on pop because they are no longer their node's `heap_entry`. When
    stale entries outnumber live ones the heap is rebuilt, so its size stays O(live) and each
    operation O(log n) amortised. Entries are tuples of ints (no node reference), which the
    garbage collector stops tracking.
    """

    __slots__ = ("_heap", "_key", "_members")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._heap: list[HeapEntry] = []
        self._key = policy.key
        self._members: dict[int, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._members

    def push(self, node: TreeNode) -> None:
        """Add `node`, or re-key it if already present (its old entry goes stale)."""
        k1, k2 = self._key(node)
        entry: HeapEntry = (k1, k2, node.id)
        node.heap_entry = entry
        self._members[node.id] = node
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._members) + 1024:
            self._compact()

    def put_back(self, node: TreeNode, entry: HeapEntry) -> None:
        """Add absent `node` with the key of `entry`, an entry it had before (an undo: the
        order it had then, even if its policy fields moved since without a re-key)."""
        assert node.id not in self._members, f"LeafHeap.put_back: node {node.id} is present"
        # A new tuple: the old one may still lie in the heap, stale.
        fresh: HeapEntry = (entry[0], entry[1], entry[2])
        node.heap_entry = fresh
        self._members[node.id] = node
        heap = self._heap
        heapq.heappush(heap, fresh)
        if len(heap) > 2 * len(self._members) + 1024:
            self._compact()

    def discard(self, node: TreeNode) -> None:
        """Remove `node` if present (O(1): its entry just goes stale)."""
        if self._members.pop(node.id, None) is not None:
            node.heap_entry = None

    def pop(self) -> TreeNode | None:
        """Remove and return the node with the smallest key, or None when empty."""
        heap = self._heap
        members = self._members
        while heap:
            entry = heapq.heappop(heap)
            node = members.get(entry[2])
            if node is not None and node.heap_entry is entry:
                del members[entry[2]]
                node.heap_entry = None
                return node
        return None

    def peek(self) -> TreeNode | None:
        """The node `pop` would return, without removing it."""
        heap = self._heap
        members = self._members
        while heap:
            entry = heap[0]
            node = members.get(entry[2])
            if node is not None and node.heap_entry is entry:
                return node
            heapq.heappop(heap)
        return None

    def victims(self, amount: int, page: int) -> Iterator[tuple[TreeNode, int]]:
        """The leaves an eviction of at least `amount` tokens takes, in heap order, page-granular:
        each with `keep`, the tokens (whole pages of `page`) it keeps. A leaf with `keep` <= 0
        goes whole: the caller takes it out of the heap before asking for the next. The first
        with `keep` > 0 is the last: only its tail goes (at most `page - 1` tokens more than
        asked). Each counts `len(node.value)` tokens, read before it is yielded."""
        freed = 0
        while freed < amount:
            node = self.peek()
            if node is None:
                return
            size = len(node.value)
            keep = size - -(-(amount - freed) // page) * page
            yield node, keep
            if keep > 0:
                return
            freed += size

    def pop_peeked(self, node: TreeNode) -> None:
        """Remove `node`, which the last `peek()` returned (its entry is on top of the heap)."""
        entry = heapq.heappop(self._heap)
        assert entry is node.heap_entry, "LeafHeap.pop_peeked: the top entry is not that node's"
        del self._members[node.id]
        node.heap_entry = None

    def clear(self) -> None:
        for node in self._members.values():
            node.heap_entry = None
        self._members.clear()
        self._heap.clear()

    def _live(self, entry: HeapEntry) -> bool:
        node = self._members.get(entry[2])
        return node is not None and node.heap_entry is entry

    def _compact(self) -> None:
        live = [e for e in self._heap if self._live(e)]
        heapq.heapify(live)
        self._heap = live
        assert len(live) == len(self._members), "LeafHeap: a member lost its heap entry"

    def check_integrity(self) -> None:
        """Every member has its current entry in the heap (O(n); raises IntegrityError)."""
        present = sum(1 for e in self._heap if self._live(e))
        if present != len(self._members):
            raise IntegrityError(
                f"LeafHeap: {present} live entries for {len(self._members)} members"
            )
        for node_id, node in self._members.items():
            if node.id != node_id or node.heap_entry is None:
                raise IntegrityError(f"LeafHeap: member {node_id} without its entry")


class _Link:
    __slots__ = ("next", "node", "prev")

    def __init__(self, node: TreeNode | None) -> None:
        self.node = node
        self.prev: _Link = self
        self.next: _Link = self


class LRUList:
    """Least-recently-used order of the nodes holding one component's unlocked data (SWA, Mamba).

    A doubly linked list threaded by a dict, so touching, removing and inserting before a given
    node are O(1), including internal nodes (which the Full leaf heap never holds). The LRU end
    is `pop_lru()`; `touch` moves a node to the MRU end.

    Between `start_log()` and `stop_log()` every change is recorded (the node and its more
    recently used neighbour before the change), so `undo_log()` can put back the exact order
    (`evict` rolls back with it when it raises).
    """

    __slots__ = ("_head", "_links", "_log")

    def __init__(self) -> None:
        self._head = _Link(None)  # sentinel: head.next is the LRU end, head.prev the MRU end
        self._links: dict[TreeNode, _Link] = {}
        #: (node, its next more recently used node or None, whether it was listed) per change.
        self._log: list[tuple[TreeNode, TreeNode | None, bool]] | None = None

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._links

    def _unlink(self, link: _Link) -> None:
        if self._log is not None:
            assert link.node is not None
            self._log.append((link.node, link.next.node, True))
        link.prev.next = link.next
        link.next.prev = link.prev

    def _link_before(self, link: _Link, ref: _Link) -> None:
        link.prev = ref.prev
        link.next = ref
        ref.prev.next = link
        ref.prev = link

    def touch(self, node: TreeNode) -> None:
        """Make `node` the most recently used (adding it if absent)."""
        link = self._links.get(node)
        if link is None:
            link = self._links[node] = _Link(node)
            if self._log is not None:
                self._log.append((node, None, False))
        else:
            self._unlink(link)
        self._link_before(link, self._head)

    def insert_before(self, node: TreeNode, ref: TreeNode) -> None:
        """Add `node` just less recently used than `ref` (which must be present)."""
        assert node not in self._links, f"LRUList: node {node.id} already listed"
        link = self._links[node] = _Link(node)
        if self._log is not None:
            self._log.append((node, None, False))
        self._link_before(link, self._links[ref])

    def discard(self, node: TreeNode) -> None:
        link = self._links.pop(node, None)
        if link is not None:
            self._unlink(link)

    def pop_lru(self) -> TreeNode | None:
        """Remove and return the least recently used node, or None when empty."""
        link = self._head.next
        if link is self._head:
            return None
        self._unlink(link)
        node = link.node
        assert node is not None
        del self._links[node]
        return node

    def start_log(self) -> None:
        """Record every change from now on (for `undo_log`)."""
        self._log = []

    def stop_log(self) -> None:
        """Stop recording and forget the record."""
        self._log = None

    def undo_log(self) -> None:
        """Undo every change since `start_log()`, newest first, and stop recording: each node
        goes back just before the neighbour it had (present again at that point of the undo)."""
        log = self._log
        assert log is not None, "LRUList.undo_log without start_log"
        self._log = None
        links = self._links
        for node, after, listed in reversed(log):
            link = links.pop(node, None)
            if link is not None:
                link.prev.next = link.next
                link.next.prev = link.prev
            if listed:
                link = links[node] = _Link(node)
                self._link_before(link, self._head if after is None else links[after])

    def nodes(self) -> list[TreeNode]:
        """LRU first (for tests and integrity checks)."""
        out: list[TreeNode] = []
        link = self._head.next
        while link is not self._head:
            assert link.node is not None
            out.append(link.node)
            link = link.next
        return out

    def clear(self) -> None:
        self._links.clear()
        self._head.prev = self._head.next = self._head
