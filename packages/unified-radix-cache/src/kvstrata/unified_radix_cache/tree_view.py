"""`TreeView`: what a component (and the event log) may call on the tree that holds it.

Components and the tree refer to each other: the tree calls the component hooks, a component
splits nodes, removes leaves or asks the tree to cascade an eviction. This protocol is the
component's side of that, defined below both, so neither module imports the other (tree.py
imports the components; components/*.py import only this). `UnifiedRadixCache` implements it
with `C` its component base (`TreeView[TreeComponent]`); the type parameter keeps this module
free of the components as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.policies import EvictionPolicy

C = TypeVar("C")


class TreeView(Protocol[C]):
    """The narrow interface of a tree to its components `C`."""

    #: Tokens per page; nodes hold whole pages.
    page_size: int
    #: Whether inserts check their slots against the allocator (`check_slots=`).
    check_slots: bool
    #: Nodes in the tree (the root excluded); an eviction roll-back puts removed ones back.
    num_nodes: int

    @property
    def policy(self) -> EvictionPolicy: ...

    @property
    def components(self) -> Sequence[C]: ...

    def component(self, name: str) -> C: ...

    def iter_nodes(self) -> list[TreeNode]: ...

    def split_node(self, node: TreeNode, num_tokens: int) -> TreeNode: ...

    def remove_leaf(self, node: TreeNode, *, evicted: bool) -> int: ...

    def truncate_leaf(self, node: TreeNode, keep: int) -> int: ...

    def evict_component(self, node: TreeNode, component: C) -> int: ...

    def flush_pending(self) -> None: ...


class PagedTree(Protocol):
    """A tree seen only for its page size (what the event log reads)."""

    @property
    def page_size(self) -> int: ...
