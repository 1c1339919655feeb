"""`evict` on a tree with state components (Full + SWA, Full + Mamba) or a host tier, all or
nothing.

Components evict in turn (on a tree with a host tier, Full's part is the tier's device walk,
`HostTier.evict_device`, which moves nodes with a host copy off the device) and only queue
their frees; before any allocator sees one, each component's queued slots are checked as its
`flush()` would check them (Full and Mamba: the allocator's `check_allocated` and, where
insert did not rule it out, no slot twice; SWA: the full slots' range, as `free_swa` checks it,
and no SWA slot twice). A refusal, or any other exception while the components evict, puts the
tree back exactly as it was from an `EvictJournal` and raises with the allocators untouched:

- nodes: before a leaf leaves the tree (`remove_leaf`), a node is split, goes off the device or
  becomes a tombstone, the tree records its place, key, slots, component data and host copies
  (`node.host_value`, `node.comp_hosts`: a split slices them); undone newest first, a split
  node takes its upper half back and every removed node its place;
- LRU lists (SWA, Mamba): their change log (`LRUList.start_log`) restores the exact order;
- the heaps: after the nodes are back, every node the evict touched is in the Full leaf heap
  exactly when it is an unlocked device leaf (with a host tier: on the device, no child on the
  device) and in the host tier's candidate heap exactly when it is off the device, childless
  and host-unlocked (its policy key did not change, so the order holds);
- sizes, counters, the host candidates' per-component counts, node count, queued frees and
  queued events: snapshots taken at the start.

A device eviction never frees host slots (a node going off the device keeps its host copy), so
the host allocators and the host tier's sizes are not touched before the check.
A Full-only device tree has its own, cheaper roll-back (`FullComponent.evict_checked`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.errors import IndexOutOfRange, NotAllocated, ReservedIndex
from kvstrata.unified_radix_cache.components.base import LRUListComponent, TreeComponent
from kvstrata.unified_radix_cache.components.full import FullComponent, has_repeats
from kvstrata.unified_radix_cache.components.swa import SWAComponent
from kvstrata.unified_radix_cache.errors import (
    HeldSlotsNotAllocated,
    HeldSlotsRepeated,
    InvalidEvictRequest,
)
from kvstrata.unified_radix_cache.node import NO_CHILDREN

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvstrata.unified_radix_cache.events import EventLog
    from kvstrata.unified_radix_cache.node import ComponentValue, HeapEntry, TreeNode
    from kvstrata.unified_radix_cache.policies import LeafHeap, LRUList
    from kvstrata.unified_radix_cache.tier_hooks import TreeTier

_Record = tuple[
    "TreeNode",
    "TreeNode",
    bytes,
    "npt.NDArray[np.int64]",
    "list[bytes] | None",
    "list[ComponentValue] | None",
    "npt.NDArray[np.int64] | None",
    "list[ComponentValue] | None",
    "HeapEntry | None",
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

    __slots__ = (
        "_candidates",
        "_lrus",
        "_num_nodes",
        "_pending",
        "_queued",
        "_records",
        "_sizes",
        "_tree",
    )

    def __init__(self, tree: EvictingTree) -> None:
        components = tree.components
        self._tree = tree
        self._sizes = [(c.evictable_size, c.protected_size, c.evicted_total) for c in components]
        self._pending = [len(c._pending) for c in components]
        self._num_nodes = tree.num_nodes
        events = tree._events
        self._queued = len(events.queue) if events is not None else 0
        tier = tree.host_tier
        self._candidates = list(tier.candidate_sizes) if tier is not None else None
        self._records: list[_Record] = []
        # `type(c) is not FullComponent` first: an ABC's isinstance is slow, and Full is
        # never an LRU-list component.
        self._lrus: list[LRUList] = [
            c.lru
            for c in components
            if type(c) is not FullComponent and isinstance(c, LRUListComponent)
        ]
        for lru in self._lrus:
            lru.start_log()

    def node(self, node: TreeNode) -> None:
        """`node` (in the tree, not the root) is about to be split, removed, taken off the device
        or tombstoned."""
        parent = node.parent
        assert parent is not None, "EvictJournal: the root never changes in an evict"
        values = node.comp_values
        hosts = node.comp_hosts
        self._records.append(
            (
                node,
                parent,
                node.key,
                node.value,
                node.page_keys,
                list(values) if values is not None else None,
                node.host_value,
                list(hosts) if hosts is not None else None,
                # Its Full leaf heap entry, if any (a device evict takes no host candidate).
                node.heap_entry if node in self._tree._heap else None,
            )
        )

    def close(self) -> None:
        """The evict went through: stop recording."""
        for lru in self._lrus:
            lru.stop_log()

    def __enter__(self) -> EvictJournal:
        """The tree records into this journal inside the `with` block."""
        self._tree._journal = self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """Normal exit: `close()`; any exception: `roll_back()` (then it propagates)."""
        self._tree._journal = None
        if kind is None:
            self.close()
        else:
            self.roll_back()

    def roll_back(self) -> None:
        """Put the tree back as it was when the journal was made."""
        tree = self._tree
        root = tree.root
        page_bytes = tree._page_bytes
        touched: list[TreeNode] = []
        entries: dict[int, HeapEntry] = {}
        for record in reversed(self._records):
            node, parent, key, value, page_keys, values, host, hosts, entry = record
            if entry is not None:
                entries[node.id] = entry  # the oldest record's is the entry before the evict
            if node.parent is not None and node.parent is not parent:
                touched.append(node.parent)  # the upper half of a split: it leaves the tree
            node.key, node.value, node.page_keys, node.parent = key, value, page_keys, parent
            if values is not None:
                assert node.comp_values is not None
                node.comp_values[:] = values
            node.host_value = host
            node.comp_hosts = hosts
            if parent.children is NO_CHILDREN:
                parent.children = {}
            first = key[:page_bytes]
            parent.children[(node.namespace, first) if parent is root else first] = node
            touched.append(node)
            touched.append(parent)
        self._records.clear()
        for lru in self._lrus:
            lru.undo_log()
        self._settle_heaps(touched, entries)
        for component, sizes, pending in zip(
            tree.components, self._sizes, self._pending, strict=True
        ):
            component.evictable_size, component.protected_size, component.evicted_total = sizes
            del component._pending[pending:]
        tier = tree.host_tier
        if tier is not None and self._candidates is not None:
            tier.candidate_sizes[:] = self._candidates
        tree.num_nodes = self._num_nodes
        events = tree._events
        if events is not None:
            del events.queue[self._queued :]

    def _settle_heaps(self, touched: list[TreeNode], entries: Mapping[int, HeapEntry]) -> None:
        """Each touched node back in the heaps it belongs to now the nodes are back: the Full
        leaf heap when it is an unlocked device leaf (with the entry it had before the evict,
        `entries`, so its place in the order is the one it had: a key can be older than the
        node's policy fields), the host candidate heap when it is off the device, childless
        and host-unlocked (hierarchical mode). A node is in at most one (they share
        `heap_entry`), so it leaves the wrong one before it joins the right one."""
        tree = self._tree
        root = tree.root
        page_bytes = tree._page_bytes
        heap = tree._heap
        tier = tree.host_tier
        hosts = tier.heap if tier is not None else None
        for node in touched:
            parent = node.parent
            if parent is None:
                continue  # the root
            first = node.key[:page_bytes]
            listed = parent.children.get((node.namespace, first) if parent is root else first)
            leaf = candidate = False
            if listed is node:
                if hosts is None:
                    leaf = not node.children and node.lock_ref == 0
                elif len(node.value):
                    leaf = node.lock_ref == 0 and not any(
                        len(c.value) for c in node.children.values()
                    )
                else:
                    candidate = not node.children and node.host_lock_ref == 0
            if not leaf and node in heap:
                heap.discard(node)
            if hosts is not None and not candidate and node in hosts:
                hosts.discard(node)
            if leaf:
                entry = entries.get(node.id)
                if entry is None:
                    if node not in heap:
                        heap.push(node)
                elif node.heap_entry != entry:
                    heap.discard(node)
                    heap.put_back(node, entry)
            if candidate and hosts is not None and node not in hosts:
                hosts.push(node)


def _queued(component: TreeComponent, start: int) -> npt.NDArray[np.int64] | None:
    pending = component._pending[start:]
    if not pending:
        return None
    return pending[0] if len(pending) == 1 else np.concatenate(pending)


def check_frees(
    component: TreeComponent, slots: npt.NDArray[np.int64], *, repeats: bool = True
) -> None:
    """Raise HeldSlotsNotAllocated / HeldSlotsRepeated if `component.flush()` would have its
    allocator (the one it frees into now) refuse `slots` (changes nothing). `repeats`: also
    refuse a slot listed twice (off for Full slots of a tree whose insert ruled repeats out).
    An allocator without `check_allocated` is trusted for what only it can tell."""
    allocator = getattr(component, "allocator", None)
    if type(component) is FullComponent:
        _check_full(component, slots, repeats=repeats)
        return
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
    if repeats and has_repeats(freed):
        raise HeldSlotsRepeated(
            f"evict: the tree holds some {component.name} slots twice (a double free); "
            "nothing was evicted"
        )


def evict_full_tiered(tree: EvictingTree, amount: int) -> None:
    """`evict_components(tree, {"full": amount})` for a tree whose only component is Full and
    which has a host tier, in one pass: the tier's device walk, one check of the queued slots
    (`check_frees`: the allocator's `check_allocated`, and no slot twice unless insert ruled
    repeats out), one `free`. Same effect, refusals and roll-back."""
    full = tree.components[0]
    tier = tree.host_tier
    assert isinstance(full, FullComponent) and tier is not None, "a tiered Full-only tree"
    pending = full._pending
    start = len(pending)
    with EvictJournal(tree):
        tier.evict_device(amount)
        if len(pending) > start:
            slots = pending[start] if len(pending) == start + 1 else np.concatenate(pending[start:])
            if len(slots):
                check_frees(full, slots, repeats=not tree.check_slots)
    full.flush()


def _check_full(full: FullComponent, slots: npt.NDArray[np.int64], *, repeats: bool) -> None:
    """`check_frees` of Full slots (same checks, errors and messages)."""
    check = getattr(full.allocator, "check_allocated", None)
    if callable(check):
        try:
            check(full.to_device(slots), "evict: full slots the tree holds")
        except (IndexOutOfRange, NotAllocated, ReservedIndex) as exc:
            raise HeldSlotsNotAllocated(
                "evict: the full allocator would refuse slots the tree holds (freed behind the "
                f"tree's back?); nothing was evicted: {exc}"
            ) from exc
    if repeats and has_repeats(slots):
        raise HeldSlotsRepeated(
            "evict: the tree holds some full slots twice (a double free); nothing was evicted"
        )


def evict_targets(tree: EvictingTree, targets: Mapping[str, int]) -> dict[str, int]:
    """`UnifiedRadixCache.evict` past its Full-only device fast path (a tree with other
    components or a host tier): unknown component names are refused first, then all or
    nothing (`evict_components`). Returns what each component freed."""
    components = tree.components
    names = [c.name for c in components]
    for name in targets:
        if name not in names:
            raise InvalidEvictRequest(f"no component {name!r} in this tree (have {sorted(names)})")
    before = [c.evicted_total for c in components]
    evict_components(tree, targets)
    return {c.name: c.evicted_total - b for c, b in zip(components, before, strict=True)}


def evict_components(tree: EvictingTree, targets: Mapping[str, int]) -> None:
    """Each component frees its target by its own order (Full on a tree with a host tier: the
    tier's device walk), all or nothing (module docstring); the queued slots reach the
    allocators, one `free` call per component, only when every component's slots passed their
    check."""
    components = tree.components
    tier = tree.host_tier
    starts = [len(c._pending) for c in components]
    with EvictJournal(tree):
        for component in components:
            target = targets.get(component.name, 0)
            if target > 0:
                if tier is not None and isinstance(component, FullComponent):
                    tier.evict_device(target)
                else:
                    component.evict(target)
        for component, start in zip(components, starts, strict=True):
            slots = _queued(component, start)
            if slots is not None and len(slots):
                # A tree that checks insert slots refused repeats of Full slots and slots it
                # held: only the range and the allocator's marks are left to check (one call).
                full_checked = isinstance(component, FullComponent) and tree.check_slots
                check_frees(component, slots, repeats=not full_checked)
    for component in components:
        component.flush()
