"""`check_integrity()` of the tree: every invariant, recomputed from scratch (O(n), for tests).

    for each pool:  free (allocator) + evictable + protected + held == capacity

plus the structure (child keys, parent links, namespaces, whole pages, leaves without a dict of
their own), the counters, the lock counts implied by the outstanding receipts, and each
component's own per-node rules (heap and LRU membership, tombstones without locks, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstrata.unified_radix_cache.errors import IntegrityError
from kvstrata.unified_radix_cache.key import TOKEN_BYTES
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals


def _check_structure(tree: TreeInternals) -> list[TreeNode]:
    """Walk the tree checking links and keys; return every non-root node."""
    page_bytes = tree.page_size * TOKEN_BYTES
    root = tree.root
    nodes: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        for ckey, child in node.children.items():
            first = child.key[:page_bytes]
            if ckey != ((child.namespace, first) if node is root else first):
                raise IntegrityError(f"node {child.id} is filed under the wrong child key")
            if child.parent is not node:
                raise IntegrityError(f"node {child.id} has a stale parent link")
            if node is not root and child.namespace != node.namespace:
                raise IntegrityError(f"node {child.id} left its parent's namespace")
            stack.append(child)
        if node is root:
            continue
        nodes.append(node)
        if not node.key or len(node.key) % page_bytes:
            raise IntegrityError(f"node {node.id} has {len(node.key)} key bytes: not whole pages")
        if not node.children and node.children is not NO_CHILDREN:
            raise IntegrityError(f"leaf {node.id} keeps an empty children dict")
        if node.page_keys is not None and len(node.page_keys) != node.num_tokens // tree.page_size:
            raise IntegrityError(f"node {node.id}: page keys do not match its pages")
    if len(nodes) != tree.num_nodes:
        raise IntegrityError(f"{len(nodes)} nodes reachable, counter says {tree.num_nodes}")
    return nodes


def check_tree(tree: TreeInternals, held: Mapping[str, int]) -> None:
    nodes = _check_structure(tree)
    components = tree.components
    for component in components:
        evictable = protected = 0
        for node in nodes:
            component.check_node(node)
            amount = component.node_size(node)
            if component.node_lock(node):
                protected += amount
            else:
                evictable += amount
        if (evictable, protected) != (component.evictable_size, component.protected_size):
            raise IntegrityError(
                f"{component.name}: counted evictable/protected {evictable}/{protected}, "
                f"counters say {component.evictable_size}/{component.protected_size}"
            )
        free = component.free_size()
        extra = held.get(component.name, 0)
        if free + evictable + protected + extra != component.capacity():
            raise IntegrityError(
                f"{component.name} pool: free {free} + evictable {evictable} + protected "
                f"{protected} + held {extra} != capacity {component.capacity()}"
            )
        component.check_locks(tree.outstanding_receipts())
