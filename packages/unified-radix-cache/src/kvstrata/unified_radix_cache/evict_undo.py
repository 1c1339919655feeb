"""`evict` on a device-only tree with state components (Full + SWA, Full + Mamba), all or nothing.

Components evict in turn and only queue their frees; before any allocator sees one, each
component's queued slots are checked as its `flush()` would check them (Full and Mamba:
`check_allocated` and no slot twice; SWA: the full slots' range, as `free_swa` checks it, and no
SWA slot twice). A refusal, or any other exception while the components evict, puts the tree
back exactly as it was from an `EvictJournal` and raises with the allocators untouched:

- nodes: before a leaf leaves the tree (`remove_leaf`), a node is split for a tail eviction or
  becomes a tombstone, the tree records its place, key, slots and component data; undone
  newest first, a split node takes its upper half back and every removed node its place;
- LRU lists (SWA, Mamba): their change log (`LRUList.start_log`) restores the exact order;
- the Full leaf heap: after the nodes are back, every node the evict touched is in it exactly
  when it is an unlocked leaf of the tree (its policy key did not change, so the order holds);
- sizes, counters, node count, queued frees and queued events: snapshots taken at the start.

A Full-only device tree has its own, cheaper roll-back (`FullComponent.evict_checked`); a
hierarchical tree checks the Full slots of its device walk before the walk (`evict_tiered`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.errors import IndexOutOfRange, NotAllocated, ReservedIndex
from kvstrata.unified_radix_cache.components.base import LRUListComponent, TreeComponent
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.swa import SWAComponent
from kvstrata.unified_radix_cache.errors import HeldSlotsNotAllocated, HeldSlotsRepeated
from kvstrata.unified_radix_cache.node import NO_CHILDREN

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvstrata.unified_radix_cache.events import EventLog
    from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
    from kvstrata.unified_radix_cache.policies import LeafHeap, LRUList
    from kvstrata.unified_radix_cache.tier_hooks import TreeTier

_Record = tuple[
    "TreeNode",
    "TreeNode",
    bytes,
    "npt.NDArray[np.int64]",
    "list[bytes] | None",
    "list[ComponentValue] | None",
]


class EvictingTree(Protocol):
    """What an evict here reads and writes on the tree (`UnifiedRadixCache` implements it;
    typed so, this module never imports tree.py, which imports it)."""

    num_nodes: int
    check_slots: bool
    host_tier: TreeTier | None
    _page_bytes: int
    _heap: LeafHeap
    _events: EventLog | None
    _journal: EvictJournal | None

    @property
    def root(self) -> TreeNode: ...

    @property
    def components(self) -> tuple[TreeComponent, ...]: ...


class EvictJournal:
    """Undo record of one `evict` (see the module docstring). Built at the start of the evict;
    the tree calls `node()` before it changes a node; `roll_back()` or `close()` ends it."""

    __slots__ = ("_lrus", "_num_nodes", "_pending", "_queued", "_records", "_sizes", "_tree")

    def __init__(self, tree: EvictingTree) -> None:
        components = tree.components
        self._tree = tree
        self._sizes = [(c.evictable_size, c.protected_size, c.evicted_total) for c in components]
        self._pending = [len(c._pending) for c in components]
        self._num_nodes = tree.num_nodes
        events = tree._events
        self._queued = len(events.queue) if events is not None else 0
        self._records: list[_Record] = []
        self._lrus: list[LRUList] = [c.lru for c in components if isinstance(c, LRUListComponent)]
        for lru in self._lrus:
            lru.start_log()

    def node(self, node: TreeNode) -> None:
        """`node` (in the tree, not the root) is about to be split, removed or tombstoned."""
        parent = node.parent
        assert parent is not None, "EvictJournal: the root never changes in an evict"
        values = node.comp_values
        self._records.append(
            (
                node,
                parent,
                node.key,
                node.value,
                node.page_keys,
                list(values) if values is not None else None,
            )
        )

    def close(self) -> None:
        """The evict went through: stop recording."""
        for lru in self._lrus:
            lru.stop_log()

    def roll_back(self) -> None:
        """Put the tree back as it was when the journal was made."""
        tree = self._tree
        root = tree.root
        page_bytes = tree._page_bytes
        touched: list[TreeNode] = []
        for node, parent, key, value, page_keys, values in reversed(self._records):
            if node.parent is not None and node.parent is not parent:
                touched.append(node.parent)  # the upper half of a split: it leaves the tree
            node.key, node.value, node.page_keys, node.parent = key, value, page_keys, parent
            if values is not None:
                assert node.comp_values is not None
                node.comp_values[:] = values
            if parent.children is NO_CHILDREN:
                parent.children = {}
            first = key[:page_bytes]
            parent.children[(node.namespace, first) if parent is root else first] = node
            touched.append(node)
            touched.append(parent)
        self._records.clear()
        for lru in self._lrus:
            lru.undo_log()
        heap = tree._heap
        for node in touched:
            parent = node.parent
            if parent is None:
                continue  # the root
            first = node.key[:page_bytes]
            listed = parent.children.get((node.namespace, first) if parent is root else first)
            evictable = listed is node and not node.children and node.lock_ref == 0
            if evictable and node not in heap:
                heap.push(node)
            elif not evictable and node in heap:
                heap.discard(node)
        for component, sizes, pending in zip(
            tree.components, self._sizes, self._pending, strict=True
        ):
            component.evictable_size, component.protected_size, component.evicted_total = sizes
            del component._pending[pending:]
        tree.num_nodes = self._num_nodes
        events = tree._events
        if events is not None:
            del events.queue[self._queued :]


def _queued(component: TreeComponent, start: int) -> npt.NDArray[np.int64] | None:
    pending = component._pending[start:]
    if not pending:
        return None
    return pending[0] if len(pending) == 1 else np.concatenate(pending)


def check_frees(component: TreeComponent, slots: npt.NDArray[np.int64]) -> None:
    """Raise HeldSlotsNotAllocated / HeldSlotsRepeated if `component.flush()` would have its
    allocator refuse `slots` (changes nothing). An allocator without `check_allocated` is
    trusted for what only it can tell."""
    allocator = getattr(component, "allocator", None)
    tensor = torch.from_numpy(slots)
    device = getattr(component, "device", None)
    if isinstance(device, torch.device) and device.type != "cpu":
        tensor = tensor.to(device)
    try:
        if isinstance(component, SWAComponent):
            # free_swa checks the full slots' range and frees the SWA slots still mapped.
            swa = component.allocator.translate(tensor).cpu().numpy()
            freed = swa[swa > 0]
        else:
            check = getattr(allocator, "check_allocated", None)
            if callable(check):
                check(tensor, f"evict: {component.name} slots the tree holds")
            freed = slots
    except (IndexOutOfRange, NotAllocated, ReservedIndex) as exc:
        raise HeldSlotsNotAllocated(
            f"evict: the {component.name} allocator would refuse slots the tree holds (freed "
            f"behind the tree's back?); nothing was evicted: {exc}"
        ) from exc
    if len(np.unique(freed)) != len(freed):
        raise HeldSlotsRepeated(
            f"evict: the tree holds some {component.name} slots twice (a double free); "
            "nothing was evicted"
        )


def evict_components(tree: EvictingTree, targets: Mapping[str, int]) -> None:
    """Each component frees its target by its own order, all or nothing (module docstring);
    the queued slots reach the allocators, one `free` call per component, only when every
    component's slots passed their check."""
    components = tree.components
    journal = EvictJournal(tree)
    starts = [len(c._pending) for c in components]
    tree._journal = journal
    try:
        for component in components:
            target = targets.get(component.name, 0)
            if target > 0:
                component.evict(target)
        for component, start in zip(components, starts, strict=True):
            slots = _queued(component, start)
            if slots is not None and len(slots):
                if isinstance(component, FullComponent) and tree.check_slots:
                    # insert refused repeats and slots the tree held: only the range and the
                    # allocator's marks are left to check (one call).
                    _check_full(component, slots)
                else:
                    check_frees(component, slots)
    except BaseException:
        tree._journal = None
        journal.roll_back()
        raise
    tree._journal = None
    journal.close()
    for component in components:
        component.flush()


def evict_tiered(tree: EvictingTree, targets: Mapping[str, int]) -> None:
    """Hierarchical mode: Full's device eviction takes host_tier.py's walk, the others their
    own order; then every component frees. The Full slots that walk will free are found
    (`HostTier.device_frees`, changing nothing) and checked as the device-only evict checks
    them before any node moves: a refusal raises HeldSlotsNotAllocated / HeldSlotsRepeated with
    the tree and the allocators untouched. The other components' frees (SWA, Mamba) are checked
    only by their allocators, after the walk: not rolled back yet."""
    tier = tree.host_tier
    assert tier is not None
    full = tree.components[0]
    assert isinstance(full, FullComponent)
    amount = targets.get(full.name, 0)
    if amount > 0:
        planned = tier.device_frees(amount)
        if planned:
            slots = planned[0] if len(planned) == 1 else np.concatenate(planned)
            if tree.check_slots:
                _check_full(full, slots)
            else:
                check_frees(full, slots)
    for component in tree.components:
        target = targets.get(component.name, 0)
        if target > 0:
            if component is full:
                tier.evict_device(target)
            else:
                component.evict(target)
    for component in tree.components:
        component.flush()


def _check_full(full: FullComponent, slots: npt.NDArray[np.int64]) -> None:
    check = full._check_allocated
    if check is None:
        return
    try:
        check(full.to_device(slots), "evict: tree-held slots")
    except (IndexOutOfRange, NotAllocated, ReservedIndex) as exc:
        raise HeldSlotsNotAllocated(
            f"evict: the full allocator no longer has slots the tree holds handed out (freed "
            f"behind the tree's back?); nothing was evicted: {exc}"
        ) from exc
