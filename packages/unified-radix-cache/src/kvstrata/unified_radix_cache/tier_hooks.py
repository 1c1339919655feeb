"""`TreeTier`: what a `UnifiedRadixCache` calls on the tier attached to it (hierarchical mode).

The tree knows its tier only through this protocol, so tree.py does not import the host tier
(host_tier.py imports the tree, never the other way round). `HostTier` implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.key import RadixKey
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.policies import LeafHeap
    from kvstrata.unified_radix_cache.results import InsertCall, InsertResult, MatchResult
    from kvstrata.unified_radix_cache.slot_checks import SlotChecker


class TreeTier(Protocol):
    """The tier hooks: its match and insert walks replace the tree's fast paths (a Full-only
    tree inserts through `insert_full`, a walk without component hooks), it evicts
    the tree's device data (moving what has a host copy off the device), and it follows the
    structure changes (a split, a node losing its last child). An evict that raises puts its
    host eviction candidates (`heap`) and their per-component host slot counts
    (`candidate_sizes`) back as they were (evict_undo.py)."""

    heap: LeafHeap
    candidate_sizes: list[int]

    def match(
        self, key: RadixKey, data: bytes, end: int, *, copy_state: bool = False
    ) -> MatchResult: ...

    def insert(self, call: InsertCall) -> InsertResult: ...

    def insert_full(self, call: InsertCall, checker: SlotChecker | None) -> InsertResult: ...

    def evict_device(self, amount: int) -> int: ...

    def on_split(self, upper: TreeNode, node: TreeNode) -> None: ...

    def on_child_gone(self, parent: TreeNode) -> None: ...
