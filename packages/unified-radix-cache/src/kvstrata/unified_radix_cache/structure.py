"""Node structure edits of `UnifiedRadixCache`: split a node at a page boundary, add a leaf,
take a leaf out of the tree. Components reach them through the tree's `split_node` /
`remove_leaf`; the insert walks (tree.py, hybrid.py, host_walks.py) call `add_leaf`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstrata.unified_radix_cache.key import TOKEN_BYTES, Namespace
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.base import TreeComponent
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals

# The value of a node with no device slots (and of the root): empty, and numpy's storage of an
# empty array cannot be resized, so sharing it is safe.
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)


def split_node(tree: TreeInternals, node: TreeNode, num_tokens: int) -> TreeNode:
    """Split `node` after its first `num_tokens` tokens (a whole number of pages, less than
    the node): a new node takes that head and `node`'s place under its parent; `node` keeps
    the tail, its children and its identity. Returns the new upper node. Sizes and locks are
    unchanged (the upper node copies the lock counts)."""
    cut = num_tokens * TOKEN_BYTES
    assert 0 < cut < len(node.key) and cut % tree._page_bytes == 0, (
        f"split of node {node.id} at {num_tokens} tokens: not a page boundary inside it"
    )
    parent = node.parent
    assert parent is not None, "the root never splits"
    key = node.key
    upper = new_node(
        tree,
        key=key[:cut],
        value=node.value[:num_tokens],
        parent=parent,
        namespace=node.namespace,
        tick=node.last_access,
    )
    upper.created = node.created
    upper.hit_count = node.hit_count
    upper.priority = node.priority
    upper.in_storage = node.in_storage
    if tree.host_tier is not None:
        tree.host_tier.on_split(upper, node)
    parent.children[
        (node.namespace, key[: tree._page_bytes])
        if parent is tree._root
        else key[: tree._page_bytes]
    ] = upper
    node.key = key[cut:]
    node.value = node.value[num_tokens:]
    node.parent = upper
    upper.children = {node.key[: tree._page_bytes]: node}
    if node.page_keys is not None:
        pages = num_tokens // tree.page_size
        upper.page_keys = node.page_keys[:pages]
        node.page_keys = node.page_keys[pages:]
    tree._full.on_split(upper, node)
    for component in tree._extras:
        component.on_split(upper, node)
    return upper


def add_leaf(
    tree: TreeInternals,
    parent: TreeNode,
    data: bytes,
    pos: int,
    end: int,
    slots: npt.NDArray[np.int64],
    namespace: Namespace | None,
    tick: int,
    priority: int,
    *,
    mark: bool = True,
) -> TreeNode:
    """A new on-device leaf of `tree` under `parent` for key bytes `data[pos:end]` with a copy
    of its slots (device sizes, heap and events updated; marked held for the slot check unless
    `mark` is False: the check did it). `parent` must be on the device (or the root)."""
    tree._last_walk = None
    heap = tree._heap
    if parent.heap_entry is not None:
        heap.discard(parent)  # no longer a leaf
    tree.num_nodes += 1
    leaf = TreeNode(
        next(tree._ids),
        data[pos:end],
        slots[pos // TOKEN_BYTES : end // TOKEN_BYTES].copy(),
        parent,
        namespace,
        tick,
        tree._num_components,
    )
    leaf.priority = priority
    if mark and tree._slot_checker is not None:
        tree._slot_checker.hold(leaf.value)
    first = data[pos : pos + tree._page_bytes]
    children = parent.children
    if children is NO_CHILDREN:
        parent.children = children = {}
    children[(namespace, first) if parent is tree._root else first] = leaf
    size = (end - pos) // TOKEN_BYTES
    tree._full.evictable_size += size
    tree.inserted_tokens += size
    heap.push(leaf)
    if tree._events is not None:
        tree._events.stored(tree, leaf)
    return leaf


def remove_leaf(tree: TreeInternals, node: TreeNode, *, evicted: bool) -> int:
    """Take leaf `node` (unlocked, childless) out of the tree, releasing every component's
    data on it; its parent joins the evictable leaves if it is now an unlocked leaf. Slots
    are queued and reach the allocators at the end of the calling operation. Returns the
    Full tokens removed."""
    assert not node.children and node.lock_ref == 0 and node.parent is not None, (
        f"remove_leaf({node.id}): not an unlocked leaf"
    )
    if tree._events is not None and len(node.value):
        tree._events.removed(tree, node)
    for component in tree._extras:
        if component.node_size(node):
            freed = component.release(node, node_goes=True)
            if evicted:
                component.evicted_total += freed
    full = tree._full
    if node.heap_entry is not None:
        tree._heap.discard(node)
    size = full.release(node, node_goes=True)
    if evicted:
        full.evicted_total += size
    parent = node.parent
    first = node.key[: tree._page_bytes]
    children = parent.children
    del children[(node.namespace, first) if parent is tree._root else first]
    node.parent = None
    tree.num_nodes -= 1
    if not children and parent.parent is not None:
        parent.children = NO_CHILDREN
        if tree.host_tier is not None:
            tree.host_tier.on_child_gone(parent)
        elif parent.lock_ref == 0:
            tree._heap.push(parent)
    elif tree.host_tier is not None and parent.parent is not None:
        tree.host_tier.on_child_gone(parent)
    return size


def cut_leaf_tail(tree: TreeInternals, node: TreeNode, keep: int) -> int:
    """Full-only tree: cut unlocked leaf `node` in place after its first `keep` tokens (whole
    pages), queueing the tail's slots and events. Returns the Full tokens freed."""
    if tree._events is not None:
        keys = tree._events.page_keys(tree, node)
        pages = keep // tree.page_size
        tree._events.removed_keys(keys[pages:])
        node.page_keys = keys[:pages]
    full = tree._full
    full.queue_free(node.value[keep:])
    freed = len(node.value) - keep
    node.value = node.value[:keep]
    node.key = node.key[: keep * TOKEN_BYTES]
    full.evictable_size -= freed
    full.evicted_total += freed
    return freed


def add_off_device_child(
    tree: TreeInternals,
    parent: TreeNode,
    key: bytes,
    namespace: Namespace | None,
    tick: int,
) -> TreeNode:
    """A new node under `parent` for `key` with no device slots (the caller gives it a host
    value). Only the structure changes: no size, heap or event."""
    node = new_node(
        tree, key=key, value=_EMPTY_SLOTS, parent=parent, namespace=namespace, tick=tick
    )
    children = parent.children
    if children is NO_CHILDREN:
        parent.children = children = {}
    first = key[: tree._page_bytes]
    children[(namespace, first) if parent is tree.root else first] = node
    return node


def new_root(num_components: int) -> TreeNode:
    """An empty root: locked once (shared by every namespace, never evicted), with its own
    children dict."""
    root = TreeNode(0, b"", _EMPTY_SLOTS, None, None, 0, num_components)
    root.lock_ref = 1
    root.children = {}
    return root


def new_node(
    tree: TreeInternals,
    *,
    key: bytes,
    value: npt.NDArray[np.int64],
    parent: TreeNode,
    namespace: Namespace | None,
    tick: int,
) -> TreeNode:
    """A new node (counted in `tree.num_nodes`); the caller links it under `parent`."""
    tree.num_nodes += 1
    return TreeNode(next(tree._ids), key, value, parent, namespace, tick, tree._num_components)


def clear(tree: TreeInternals) -> None:
    """Take every node out of the tree, queue every component's data on them for its
    allocator and hand it over (`reset`; the caller checked that nothing is locked)."""
    stack = list(tree._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        for component in tree._extras:
            if component.node_size(node):
                component.release(node, node_goes=True)
        node.heap_entry = None
        tree._full.queue_free(node.value)
        node.parent = None
    tree._root.children.clear()
    tree.flush_pending()
    for component in tree._components:
        component.reset()
    tree.num_nodes = 0


def tombstone(tree: TreeInternals, node: TreeNode, component: TreeComponent) -> int:
    """`evict_component` on a node that stays: `component` and every component of lower or
    equal priority with unlocked data on `node` release it (`node` keeps its Full data).
    Returns what `component` freed."""
    if tree._journal is not None:
        tree._journal.node(node)
    freed = 0
    for other in tree._extras:
        if (
            other.priority <= component.priority
            and other.node_size(node)
            and other.node_lock(node) == 0
        ):
            amount = other.release(node, node_goes=False)
            other.evicted_total += amount
            if other is component:
                freed = amount
    return freed
