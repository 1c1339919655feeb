"""Host-tier eviction of a Full-only hierarchical tree, each pass in one frame.

`HostTier.evict_device` (device eviction: a leaf with a host copy goes off the device, one
without leaves the tree) and `HostTier.evict` (host eviction: off-device candidates leave the
tree, their host pages go back in one free) send a tree without other components here. Each
does the general path's steps in the same order (journal records, heap pops and pushes, splits,
events, sizes, frees), with the per-node helper calls inlined: same victims, same order, same
errors and the same roll-back (the tree's `EvictJournal` sees the same records). They serve
only a tree of the exact classes (`serves`).

Why `evict_host_full` stays Python (measured 2026-12-03, issue 11): its loop compiled beside
radix_evict.c (the same steps through the C API's attribute calls, the heap pushes still
method calls) cost the same per call as this loop in the `bench tiers` host run (6,160 calls,
26,139 nodes: 49-57 us per call compiled, 46-56 us here, paired rounds, thread CPU, load
6-9 on 2 cores) and moved neither loop's process CPU (host 3.94 s vs 3.86 s, storage 10.0 s
vs 9.7 s, medians of 4 and 3 rounds). A node's cost is cold memory the C code touches too
(the host heap's `heappop` over tuples of ints, about 2 us a pop, the node, its parent's
children), and `PyObject_GetAttr` is likely no faster than Python 3.11's specialised slot
reads (not timed apart). The host free after the loop (about 30-45 us a call there) costs
more than the loop's own code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.base import SlotSink


class HostTier(Protocol):
    """What these loops read and write on `host_tier.HostTier` (typed so, this module never
    imports host_tier.py, which imports it)."""

    tree: UnifiedRadixCache
    heap: LeafHeap
    host: SlotSink
    evictable_size: int
    evicted_total: int
    _device_heap: LeafHeap
    _full: FullComponent
    _page_bytes: int

    def _maybe_device_leaf(self, node: TreeNode) -> None: ...


_NO_SLOTS = np.empty(0, dtype=np.int64)


def serves(tree: UnifiedRadixCache) -> bool:
    """Whether these loops may serve `tree`'s host tier: a Full-only tree whose tree, Full
    component and device heap are of the exact classes. The loops inline `remove_leaf`,
    `FullComponent.queue_free` / `release` and the heap's membership test, so a subclass of
    any of them keeps its overrides (the per-node loops call them), as the compiled
    device-only eviction does (`native_core.install`)."""
    components = tree.components
    return (
        len(components) == 1
        and type(tree) is UnifiedRadixCache
        and type(components[0]) is FullComponent
        and type(components[0].heap) is LeafHeap
    )


def evict_device_full(tier: HostTier, amount: int) -> int:
    """`evict_device` of a Full-only tree in one frame: the same steps in the same order
    (journal records, heap pops, splits, events, candidate pushes, device-leaf pushes),
    with the heap's `victims` / pop and `_drop_device`'s Full-only part inlined."""
    tree = tier.tree
    heap = tier._device_heap
    members = heap._members
    hosts = tier.heap
    full = tier._full
    pending = full._pending
    events = tree._events
    page = tree.page_size
    freed = 0
    while freed < amount:
        node = heap.peek()
        if node is None:
            break
        keep = len(node.value) - -(-(amount - freed) // page) * page
        journal = tree._journal
        if keep > 0:
            tree.split_node(node, keep)  # records `node` (heap entry included)
        elif journal is not None:
            journal.node(node)  # before the pop (its heap entry)
        heap.pop_peeked(node)
        value = node.value
        size = len(value)
        freed += size
        if node.host_value is None:
            # No host copy: no host child either (closure), and no device child (a leaf).
            assert not node.children, f"device leaf {node.id} without host copy has children"
            tree.remove_leaf(node, evicted=True)
        else:
            if events is not None:
                events.removed(tree, node)
            pending.append(value)
            full.evictable_size -= size
            full.evicted_total += size
            node.value = _NO_SLOTS
            if not node.children and node.host_lock_ref == 0:
                hosts.push(node)  # `_add_candidate` without components to count
            parent = node.parent
            assert parent is not None, "the root is never evicted"
            if parent.parent is not None and not parent.lock_ref and parent.id not in members:
                for child in parent.children.values():
                    if len(child.value):
                        break
                else:
                    heap.push(parent)  # `_maybe_device_leaf`
        if keep > 0:
            break
    return freed


def evict_host_full(tier: HostTier, amount: int) -> int:
    """`evict` of a Full-only tree without events, in one frame: the same steps in the same
    order, with `_evict_node`, `tree.remove_leaf` and `on_child_gone` inlined for a
    candidate (off the device: no device slots to queue, no event, no journal)."""
    tree = tier.tree
    root = tree.root
    page_bytes = tier._page_bytes
    heap = tier.heap
    values: list[npt.NDArray[np.int64]] = []
    tokens = 0
    gone = 0
    try:
        while tokens < amount:
            node = heap.pop()
            if node is None:
                break
            value = node.host_value
            assert value is not None, f"host candidate {node.id} without a host value"
            assert not node.children and node.lock_ref == 0 and not len(node.value), (
                f"host candidate {node.id} is not an off-device leaf"
            )
            node.host_value = None
            values.append(value)
            tokens += len(value)
            if tree._last_walk is not None:
                tree._forget_walk()
            parent = node.parent
            assert parent is not None, "the root is never a candidate"
            first = node.key[:page_bytes]
            children = parent.children
            del children[(node.namespace, first) if parent is root else first]
            node.parent = None
            gone += 1
            if parent.parent is not None:
                if not children:
                    parent.children = NO_CHILDREN
                if len(parent.value):
                    tier._maybe_device_leaf(parent)
                elif not parent.children and parent.host_lock_ref == 0:
                    heap.push(parent)  # `_maybe_host_candidate`
    finally:
        # On an error from inside the loop too: the nodes already out of the tree are counted
        # as the per-node loop counts them (neither rolls back; their host slots stay unfreed).
        tier.evictable_size -= tokens
        tier.evicted_total += tokens
        tree.num_nodes -= gone
    tree.flush_pending()
    if values:
        tier.host.free(torch.from_numpy(np.concatenate(values)))
    return tokens
