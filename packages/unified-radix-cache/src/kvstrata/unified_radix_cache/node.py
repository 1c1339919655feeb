"""`TreeNode`: one run of whole pages of a prefix, and what each component holds for it.

Layout (component 0 is always `FullComponent`; its data lives in plain attributes because every
hot loop reads it):

    key           bytes      int64 token ids of the run, a whole number of pages
    value         ndarray    Full: device slot of each token (int64, owned by the tree); empty
                             = off the device (hierarchical mode only: the host copy remains)
    lock_ref      int        Full: running requests protecting this node
    comp_values   list       per component index >= 1: its data or None (a tombstone)
    comp_locks    list[int]  per component index >= 1: its lock count
    children      dict       first page's bytes -> child (at the root: (namespace, bytes));
                             a leaf shares the read-only NO_CHILDREN instead of its own dict
    host_value    ndarray    hierarchical mode: host token slot of each token, or None
    host_lock_ref int        hierarchical mode: transfers protecting the host copy
    comp_hosts    list       hierarchical mode, per component index >= 1: that component's
                             host copy on this node or None (its type is the component's
                             business, see `TreeComponent.host_value`); None until a
                             component stores its first host copy here
    in_storage    bool       hierarchical mode: storage acknowledged this node's pages

A node's namespace is the one of the root child it descends from, so below the root a child is
found by the bytes of its first page alone.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from kvstrata.unified_radix_cache.key import TOKEN_BYTES, Namespace

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Heap entry of an evictable leaf: (policy key 1, policy key 2, node id). Ints only, so the
#: garbage collector stops tracking it: a large tree adds few objects to each GC pass.
HeapEntry = tuple[int, int, int]
#: Data a non-Full component keeps on a node, on the device or on the host (a slot array or one
#: slot; each component says which).
ComponentValue = npt.NDArray[np.int64] | int | None


#: The children of every leaf: read-only and shared, so a leaf costs no dict (one tracked
#: object less per leaf for the garbage collector). The tree gives a node its own dict when it
#: gets a first child and drops it when the last one goes.
NO_CHILDREN = cast("dict[object, TreeNode]", MappingProxyType({}))


class TreeNode:
    """A node of `UnifiedRadixCache`. Fields are read by components and tests; only the tree and
    its components mutate them. Nodes compare by identity."""

    __slots__ = (
        "children",
        "comp_hosts",
        "comp_locks",
        "comp_values",
        "created",
        "heap_entry",
        "hit_count",
        "host_lock_ref",
        "host_value",
        "id",
        "in_storage",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "page_keys",
        "parent",
        "priority",
        "value",
    )

    def __init__(
        self,
        node_id: int,
        key: bytes,
        value: npt.NDArray[np.int64],
        parent: TreeNode | None,
        namespace: Namespace | None,
        tick: int,
        num_components: int,
    ) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.namespace = namespace
        self.children: dict[object, TreeNode] = NO_CHILDREN
        self.lock_ref = 0
        self.last_access = tick
        self.created = tick
        self.hit_count = 0
        self.priority = 0
        self.heap_entry: HeapEntry | None = None
        # Non-Full components; None in a Full-only tree so that the fast path allocates nothing.
        if num_components > 1:
            values: list[ComponentValue] = [None] * num_components
            self.comp_values: list[ComponentValue] | None = values
            self.comp_locks: list[int] | None = [0] * num_components
        else:
            self.comp_values = None
            self.comp_locks = None
        # Chained page keys of this run (kvstrata.storage.PageKeyer), computed lazily.
        self.page_keys: list[bytes] | None = None
        # Hierarchical mode (host_tier.py): host slots of this run, their lock count, and
        # whether storage holds the pages. Device-only trees never touch them.
        self.host_value: npt.NDArray[np.int64] | None = None
        self.host_lock_ref = 0
        # Host copies of the other components (index >= 1), made on first use.
        self.comp_hosts: list[ComponentValue] | None = None
        self.in_storage = False

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    @property
    def on_device(self) -> bool:
        """Whether the device holds this run (False only for a hierarchical node kept for its
        host copy; every node of a device-only tree is on the device)."""
        return len(self.value) > 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def tokens(self) -> npt.NDArray[np.int64]:
        """The token ids of this run (read-only view of `key`)."""
        return np.frombuffer(self.key, dtype=np.int64)

    def path_to_root(self) -> Iterator[TreeNode]:
        """This node, its parent, ... up to but excluding the root."""
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )
