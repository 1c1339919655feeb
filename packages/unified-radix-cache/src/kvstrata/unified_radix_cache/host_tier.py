"""`HostTier`: the host copies of a hierarchical `UnifiedRadixCache`, kept on the tree's own nodes.

One tree, two tiers per node (SGLang HiRadixCache style): `node.value` holds the device slots and
`node.host_value` the host slots of the same run. Both are prefix-closed along every path (a node
on the device, or on the host, implies its ancestors are), and a node off the device carries a
host value (it is kept only for its host copy):

    root - A (device + host) - B (device) - C (device)        device hit: A B C
                             \\ D (host only) - E (host only)  host hit beyond A: D E

The tier attaches itself to the tree (`tree.host_tier`), which then sends match, insert and Full
eviction here (the walks: host_walks.py, `HostWalks`; a Full-only tree's evictions in one frame:
host_evict.py). Match: the device hit is the run of on-device nodes, the host hit continues over
off-device ones (`MatchResult.host_hit_len`, `last_host_node`). Insert: an off-device node the
key runs over takes the caller's slots again (revive; reported as adopted). Device eviction:
a device leaf (on-device, no on-device child) with a host copy goes off the device (the node
stays), one without leaves the tree. Host eviction: off-device, childless, host-unlocked nodes
in the host policy's order leave the tree (storage keeps their pages); for another component's
host pool it takes only candidates holding enough slots of that pool (`evict_for`).

Hybrid trees: every other component keeps its host copy of a node in `node.comp_hosts` (a
per-token slot array, or one slot for data at the end of the run), in slots of the host sink
it was given (`component_hosts`), and the tier reaches it only through the component's host
hooks (components/base.py): a host hit ends only where every component says its data is
restorable from the host (`host_hit_may_end`); device eviction of a node drops the
components' device data with its pages (`release`); a split slices or keeps the host copies
(`split_host`); host eviction frees them with the host value (`take_host` / `free_host`).
Adding a component kind needs no change here.

A host lock (`HostReceipt`) protects the host values on the path to the root, like Full's device
lock: transfers in flight hold one. The device `LeafHeap` and the host one share `heap_entry`:
a node is in at most one of them (device leaves are on the device, host candidates are not).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache.errors import (
    ForeignNode,
    IntegrityError,
    InvalidConfig,
    NoHostCopy,
    ReceiptAlreadyReleased,
    TreeLocked,
)
from kvstrata.unified_radix_cache.events import EventLog, KVEvent
from kvstrata.unified_radix_cache.host_evict import evict_device_full, evict_host_full, serves
from kvstrata.unified_radix_cache.host_walks import HostWalks
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import HeapEntry, TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap, make_policy

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.base import SlotSink, TreeComponent
    from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

HOST_TIER = "host"
_NO_SLOTS = np.empty(0, dtype=np.int64)


class HostReceipt(NamedTuple):
    """Proof of one `HostTier.lock(anchor)`: hand it to `unlock` exactly once."""

    receipt_id: int
    anchor: TreeNode


class HostEviction(NamedTuple):
    """What one `HostTier.evict_for` freed: host Full tokens, and slots of the component pool
    it evicted for."""

    tokens: int
    slots: int


@dataclass(kw_only=True, eq=False)
class _Batch:
    """Host slots of the nodes one host eviction removed, freed together at its end."""

    tokens: int = 0
    values: list[npt.NDArray[np.int64]] = field(default_factory=list)
    #: Per component index: the host slots its copies held.
    parts: dict[int, list[npt.NDArray[np.int64]]] = field(default_factory=dict)


class HostTier(HostWalks):
    """Host values, host locks, host sizes and host eviction of one tree.

    `host`: the host slot allocator (as a `SlotSink`; its indices are CPU token slots).
    `eviction_policy`: order of host eviction (lru, lfu, fifo, mru, filo, priority).
    `keyer`: names pages for host events and storage (the tree's own when it has events).
    Host events are queued only when the tree was built with events (`enable_events`): with
    them off no host page is hashed for an event (storage backups still key their pages), and
    nothing queues up for a `take_events` nobody calls.
    `component_hosts`: per component other than Full (by name), the host slot sink of its host
    copies; every such component of the tree needs one, and no other name is accepted.
    Building one attaches it to `tree` (which must be empty) and gives each component its sink.
    """

    def __init__(
        self,
        tree: UnifiedRadixCache,
        host: SlotSink,
        *,
        eviction_policy: str = "lru",
        keyer: PageKeyer | None = None,
        component_hosts: Mapping[str, SlotSink] | None = None,
    ) -> None:
        extras = tree.components[1:]
        sinks = dict(component_hosts or {})
        names = {c.name for c in extras}
        if set(sinks) != names:
            raise InvalidConfig(
                f"component_hosts must name exactly the tree's components besides Full "
                f"{sorted(names)}, got {sorted(sinks)}"
            )
        keyer = tree.keyer or keyer or PageKeyer(page_size=tree.page_size)
        if keyer.page_size != tree.page_size:
            raise InvalidConfig(f"keyer page size {keyer.page_size} != {tree.page_size}")
        if any(c.host is not None for c in extras):
            raise InvalidConfig("a component of this tree already has a host sink")
        super().__init__(tree, LeafHeap(make_policy(eviction_policy)))
        # A subclass keeps the per-node helpers the one-frame loops inline.
        self._one_frame = type(self) is HostTier and serves(tree)
        self.host = host
        self.keyer = keyer
        self._log = EventLog(keyer)
        #: Whether host events are queued (the tree's events are on).
        self.events_on = tree.keyer is not None
        self._receipts: dict[int, HostReceipt] = {}
        self._ids = itertools.count(1)
        #: Host tokens not locked / locked by a transfer, and tokens host eviction freed.
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_total = 0
        tree.attach_host_tier(self)
        for component in extras:
            component.attach_host(sinks[component.name])

    def candidate_size(self, component: str) -> int:
        """Host slots of `component` held by the host eviction candidates."""
        return self.candidate_sizes[self.tree.component(component).index]

    # ------------------------------------------------------------------------------------------
    # Device eviction
    # ------------------------------------------------------------------------------------------
    def evict_device(self, amount: int) -> int:
        """Free at least `amount` device tokens from device leaves in policy order, the last one
        page-granular (split; the tail goes). A leaf with a host copy goes off the device and
        stays; one without leaves the tree. Slots are queued on Full (the tree flushes).
        A Full-only tree (exact classes) takes `host_evict.evict_device_full` (the same steps
        in one frame)."""
        if self._one_frame:
            return evict_device_full(self, amount)
        return self._evict_device_each(amount)

    def _evict_device_each(self, amount: int) -> int:
        """`evict_device` of any tree, a helper call per node (`_drop_device`)."""
        heap = self._device_heap
        tree = self.tree
        freed = 0
        for node, keep in heap.victims(amount, tree.page_size):
            if keep > 0:
                # The lower half keeps the node's identity and heap entry (still the top); the
                # split records `node` as it was for a refused evict (heap entry included).
                tree.split_node(node, keep)
            else:
                tree.note_evicting(node)  # before the pop (its heap entry)
            heap.pop_peeked(node)
            freed += self._drop_device(node)
            if keep > 0:
                break
        return freed

    def device_frees(self, amount: int) -> list[npt.NDArray[np.int64]]:
        """The Full slots `evict_device(amount)` would queue, in its order, changing nothing
        (the device heap is walked and put back, each node with the entry it had: a re-push
        would re-key a node whose policy fields moved since its entry was made, e.g. an access
        time a match set on an inner node, and change the order the evict then takes; the keys
        end ties by node id). O(k log n) for k nodes."""
        heap = self._device_heap
        popped: list[tuple[TreeNode, HeapEntry]] = []
        pushed: list[TreeNode] = []
        gone: set[int] = set()
        slots: list[npt.NDArray[np.int64]] = []
        try:
            for node, keep in heap.victims(amount, self.tree.page_size):
                entry = node.heap_entry
                assert entry is not None, "a node in the heap has its entry"
                heap.pop_peeked(node)
                popped.append((node, entry))
                value = node.value
                if keep > 0:
                    slots.append(value[keep:])
                    break
                slots.append(value)
                gone.add(node.id)
                parent = node.parent
                assert parent is not None, "the root is never evicted"
                if (
                    parent.parent is not None
                    and len(parent.value)
                    and parent.lock_ref == 0
                    and parent not in heap
                    and all(c.id in gone or not len(c.value) for c in parent.children.values())
                ):
                    heap.push(parent)
                    pushed.append(parent)
        finally:
            # Back as it was: a parent the walk pushed (and perhaps popped again) goes out.
            for node in pushed:
                heap.discard(node)
            added = {node.id for node in pushed}
            for node, entry in popped:
                if node.id not in added:
                    heap.put_back(node, entry)
        return slots

    def _drop_device(self, node: TreeNode) -> int:
        size = len(node.value)
        if node.host_value is None:
            # No host copy: no host child either (closure), and no device child (a leaf).
            assert not node.children, f"device leaf {node.id} without host copy has children"
            self.tree.remove_leaf(node, evicted=True)
            return size
        self.tree.emit_removed(node)
        for component in self._extras:
            if component.node_size(node):
                # Device data needs the device pages: it goes with them (slots mapped from
                # the full ones are freed with them, the others are queued by the component).
                component.evicted_total += component.release(node, node_goes=True)
        full = self._full
        full.queue_free(node.value)
        full.evictable_size -= size
        full.evicted_total += size
        node.value = _NO_SLOTS
        if not node.children and node.host_lock_ref == 0:
            self._add_candidate(node)  # `_maybe_host_candidate`: it is off the device now
        parent = node.parent
        assert parent is not None, "the root is never evicted"
        if parent.parent is not None:
            self._maybe_device_leaf(parent)
        return size

    def on_child_gone(self, parent: TreeNode) -> None:
        """The tree removed a child of `parent` (not the root): it may be a leaf of a tier now."""
        if len(parent.value):
            self._maybe_device_leaf(parent)
        else:
            self._maybe_host_candidate(parent)

    def _maybe_device_leaf(self, node: TreeNode) -> None:
        heap = self._device_heap
        if node.lock_ref or node in heap:
            return
        for child in node.children.values():
            if len(child.value):
                return
        heap.push(node)

    def _maybe_host_candidate(self, node: TreeNode) -> None:
        if not node.children and node.host_lock_ref == 0 and not len(node.value):
            self._add_candidate(node)

    def on_split(self, upper: TreeNode, node: TreeNode) -> None:
        """The tree split `node` after `len(upper.value)` tokens, `upper` taking its head: the
        host copies split with it (the host tier owns them, so the tree does not copy them). A
        candidate `node` stays one (it keeps its heap entry); `upper` has a child, so is none."""
        cut = upper.num_tokens
        host_value = node.host_value
        if host_value is not None:
            upper.host_value = host_value[:cut]
            node.host_value = host_value[cut:]
            upper.host_lock_ref = node.host_lock_ref
        if node.comp_hosts is not None:
            for component in self._extras:
                component.split_host(upper, node)
            if node in self.heap:
                # `node` stays a candidate with only its tail; the head went to `upper`.
                for component in self._extras:
                    self.candidate_sizes[component.index] -= component.host_size(upper)

    # ------------------------------------------------------------------------------------------
    # Host values: commit, eviction, locks
    # ------------------------------------------------------------------------------------------
    def commit(self, receipt: HostReceipt, key: RadixKey, new_slots: torch.Tensor) -> HostReceipt:
        """Host pages `new_slots` now hold `key[base:]`, where `key[:base]` is the prefix ending
        at the locked `receipt.anchor`. Nodes on the key without a host value take theirs
        (split where the key ends inside one); past the tree's end a node off the device is
        added. Slots already covered by someone's host value are freed. The lock moves to the
        node ending at the key; returns the new receipt (the old one is released)."""
        tree = self.tree
        data = key.token_bytes()
        end = len(data)
        new = new_slots.numpy()
        base = end // TOKEN_BYTES - len(new)
        used = np.zeros(len(new), dtype=bool)
        tick = tree.next_tick()
        pos = 0
        node = tree.root
        for node in tree.walk(key.namespace, data, end):
            if node.host_value is None:
                lo = pos // TOKEN_BYTES - base
                assert lo >= 0, f"host commit: node {node.id} lacks a host copy inside the prefix"
                self._set_host(node, new[lo : lo + node.num_tokens].copy())
                used[lo : lo + node.num_tokens] = True
            pos += len(node.key)
        if pos < end:
            lo = pos // TOKEN_BYTES - base
            self._drop_candidate(node)  # an off-device node that gets a child is no candidate
            node = tree.add_off_device_child(node, data[pos:end], key.namespace, tick)
            self._set_host(node, new[lo:].copy())
            used[lo:] = True
            self._add_candidate(node)
        if not used.all():
            self.host.free(torch.from_numpy(new[~used]))
        moved = self._lock(node)
        self.unlock(receipt)
        return moved

    def commit_path(
        self,
        receipt: HostReceipt,
        node: TreeNode,
        key: RadixKey,
        new_slots: torch.Tensor | npt.NDArray[np.int64],
        *,
        keep_lock: bool = True,
    ) -> HostReceipt | None:
        """`commit` for a key that ends exactly at `node` (a write's device-locked source:
        splits since keep it the node ending at the key): the nodes without a host value are
        the run just above `node` (host values are prefix-closed), found by walking up from it
        instead of matching the key from the root. Same effect, events and receipt as
        `commit`; falls back to it when `node` does not end at the key. With `keep_lock`
        False (nothing follows that needs the key's host copy locked, e.g. no backup) the
        receipt is released and no new lock taken: returns None. `new_slots` may be the
        NumPy array of the slots (what the writer keeps: no tensor round trip). O(depth)."""
        end = len(key)
        missing: list[TreeNode] = []
        probe = node
        depth = 0
        missing_len = 0  # tokens of the nodes without a host value
        closed = False  # a node below had a host value: every one above must too
        while probe.parent is not None:
            n = len(probe.key) // TOKEN_BYTES
            if probe.host_value is None:
                assert not closed, f"host values not prefix-closed above node {probe.id}"
                missing.append(probe)
                missing_len += n
            else:
                closed = True
            depth += n
            probe = probe.parent
        if depth != end or probe is not self.tree.root:
            if isinstance(new_slots, np.ndarray):
                new_slots = torch.from_numpy(new_slots)
            moved = self.commit(receipt, key, new_slots)
            if keep_lock:
                return moved
            self.unlock(moved)
            return None
        new = new_slots if isinstance(new_slots, np.ndarray) else new_slots.numpy()
        base = end - len(new)
        # Prefix-closed: the nodes without a host value are `node` and the ones right above.
        pos = end - missing_len
        lo = pos - base
        assert lo >= 0, f"host commit: node {node.id} lacks a host copy inside the prefix"
        for item in reversed(missing):  # root side first, as `commit` (events in path order)
            n = len(item.key) // TOKEN_BYTES
            self._set_host(item, new[lo : lo + n].copy())
            lo += n
        if pos > base:  # slots for pages that got a host copy meanwhile: not needed
            self.host.free(torch.from_numpy(new[: pos - base].copy()))
        if not keep_lock:
            self.unlock(receipt)
            return None
        moved = self._lock(node)
        self.unlock(receipt)
        return moved

    def _set_host(self, node: TreeNode, value: npt.NDArray[np.int64]) -> None:
        assert node.host_lock_ref == 0, f"node {node.id} host-locked without a host value"
        node.host_value = value
        self.evictable_size += len(value)
        if self.events_on:
            self._log.stored(self.tree, node)

    def evict(self, amount: int) -> int:
        """Free at least `amount` host tokens (or all that may go): whole off-device, childless,
        host-unlocked nodes in the host policy's order; each leaves the tree. Returns the host
        tokens freed (handed to the host allocator before this returns). O(k log n).
        A Full-only tree (exact classes) without events takes `host_evict.evict_host_full`
        (the same steps in one frame)."""
        if self._one_frame and not self.events_on and self.tree._journal is None:
            return evict_host_full(self, amount)
        return self._evict_each(amount)

    def _evict_each(self, amount: int) -> int:
        """`evict` of any tree, a helper call per node (`_evict_node`, `_finish`)."""
        batch = _Batch()
        while batch.tokens < amount:
            node = self.heap.pop()
            if node is None:
                break
            self._uncount_candidate(node)
            self._evict_node(node, batch)
        self._finish(batch)
        return batch.tokens

    def evict_for(self, component: TreeComponent, amount: int) -> HostEviction:
        """Free at least `amount` host slots of `component`'s host pool by host eviction, or
        evict nothing: when the candidates (off-device, childless, host-unlocked nodes) hold
        fewer than `amount` of them in all (`candidate_sizes`, O(1)) no eviction could make
        the room, so none happens. Otherwise candidates go in the host policy's order,
        skipping those without such a host copy (they stay cached, their place in the order
        unchanged); an evicted node drops its whole host copy (every component). Returns what
        was freed (handed to the allocators before this returns). O((k + s) log n) for k
        evicted and s skipped nodes."""
        if amount <= 0 or self.candidate_sizes[component.index] < amount:
            return HostEviction(0, 0)
        return self._evict_holders(amount, component.host_size)

    def _evict_holders(self, amount: int, held: Callable[[TreeNode], int]) -> HostEviction:
        """Evict candidates with `held(node) > 0` in policy order until they freed `amount`
        (the caller checked the candidates hold that much); the others popped on the way are
        pushed back with their unchanged keys."""
        batch = _Batch()
        skipped: list[TreeNode] = []
        got = 0
        while got < amount:
            node = self.heap.pop()
            assert node is not None, f"host candidates hold {amount - got} fewer slots than counted"
            self._uncount_candidate(node)
            wanted = held(node)
            if not wanted:
                skipped.append(node)
                continue
            got += wanted
            self._evict_node(node, batch)
        for node in skipped:
            self._add_candidate(node)
        self._finish(batch)
        return HostEviction(batch.tokens, got)

    def _evict_node(self, node: TreeNode, batch: _Batch) -> None:
        """Host candidate `node` (already out of the heap) leaves the tree; its host slots join
        `batch` (freed by `_finish`). Its parent may become a candidate."""
        value = node.host_value
        assert value is not None, f"host candidate {node.id} without a host value"
        if self.events_on:
            self._log.removed(self.tree, node)
        node.host_value = None
        self.evictable_size -= len(value)
        self.evicted_total += len(value)
        batch.values.append(value)
        batch.tokens += len(value)
        if node.comp_hosts is not None:
            for component in self._extras:
                slots = component.take_host(node)
                if slots is not None:
                    batch.parts.setdefault(component.index, []).append(slots)
        self.tree.remove_leaf(node, evicted=False)

    def _finish(self, batch: _Batch) -> None:
        """Hand `batch`'s host slots to their allocators (one free call per pool)."""
        self.tree.flush_pending()
        if batch.values:
            self.host.free(torch.from_numpy(np.concatenate(batch.values)))
        for component in self._extras:
            parts = batch.parts.get(component.index)
            if parts:
                component.host_evicted_total += sum(len(p) for p in parts)
                component.free_host(parts)

    def set_host(self, component: TreeComponent, node: TreeNode, value: object) -> bool:
        """`node` (with a host value) takes `component`'s host copy `value` (its type is the
        component's: see `TreeComponent.set_host`). Returns False, taking nothing, when it
        already has one (the caller frees `value`)."""
        assert value is None or isinstance(value, (int, np.ndarray))
        if not component.set_host(node, value):
            return False
        if node in self.heap:
            self.candidate_sizes[component.index] += component.host_size(node)
        return True

    def lock(self, anchor: TreeNode) -> HostReceipt:
        """Protect the host values from `anchor` (a node with a host value, or the root) to the
        root. ForeignNode for a node not in the tree, NoHostCopy for one without a host value,
        both before anything changes. O(depth)."""
        self._check_in_tree(anchor)
        if anchor.parent is not None and anchor.host_value is None:
            raise NoHostCopy(f"node {anchor.id} has no host value to lock")
        return self._lock(anchor)

    def lock_trusted(self, anchor: TreeNode) -> HostReceipt:
        """`lock` of a node the caller knows is in the tree with a host value, or the root
        (a commit's own node, `host_prefix` of a node it just device-locked): no check."""
        return self._lock(anchor)

    def _lock(self, anchor: TreeNode) -> HostReceipt:
        probe = anchor
        while probe.parent is not None:
            value = probe.host_value
            assert value is not None, f"host lock over node {probe.id} without a host value"
            if probe.host_lock_ref == 0:
                self.evictable_size -= len(value)
                self.protected_size += len(value)
                self._drop_candidate(probe)
            probe.host_lock_ref += 1
            probe = probe.parent
        receipt = HostReceipt(next(self._ids), anchor)
        self._receipts[receipt.receipt_id] = receipt
        return receipt

    def unlock(self, receipt: HostReceipt) -> None:
        """Release exactly `receipt`'s lock. ReceiptAlreadyReleased on a second unlock."""
        if self._receipts.pop(receipt.receipt_id, None) is None:
            raise ReceiptAlreadyReleased(f"host receipt {receipt.receipt_id} is not outstanding")
        probe = receipt.anchor
        while probe.parent is not None:
            assert probe.host_lock_ref > 0, f"host unlock below zero at node {probe.id}"
            probe.host_lock_ref -= 1
            if probe.host_lock_ref == 0:
                value = probe.host_value
                assert value is not None, "a host-locked node keeps its host value"
                self.evictable_size += len(value)
                self.protected_size -= len(value)
                self._maybe_host_candidate(probe)
            probe = probe.parent

    @property
    def num_locked(self) -> int:
        return len(self._receipts)

    def receipt_ids(self) -> frozenset[int]:
        """Ids of the outstanding host receipts (for integrity checks of their holders)."""
        return frozenset(self._receipts)

    def _check_in_tree(self, node: TreeNode) -> None:
        probe = node
        while probe.parent is not None:
            probe = probe.parent
        if probe is not self.tree.root:
            raise ForeignNode(f"node {node.id} is not in this tree")

    # ------------------------------------------------------------------------------------------
    # Reads
    # ------------------------------------------------------------------------------------------
    def host_prefix(self, node: TreeNode) -> TreeNode:
        """The deepest node on the path to `node` (itself included) holding a host value, or
        the root (host values are prefix-closed, so the path above it has them all)."""
        probe = node
        while probe.parent is not None and probe.host_value is None:
            probe = probe.parent
        return probe

    def host_slots(self, node: TreeNode) -> torch.Tensor:
        """Host slots of the whole prefix ending at `node` (which must have a host value or be
        the root). Valid while `node` is host-locked. O(depth)."""
        parts: list[npt.NDArray[np.int64]] = []
        probe = node
        while probe.parent is not None:
            value = probe.host_value
            assert value is not None, f"node {probe.id} on a host prefix without a host value"
            parts.append(value)
            probe = probe.parent
        return torch.from_numpy(np.concatenate(parts[::-1]) if parts else _NO_SLOTS.copy())

    def page_keys(self, node: TreeNode, first: int = 0) -> list[bytes]:
        """Chained page keys of the prefix ending at `node` from its page `first` on (default:
        the whole prefix), root first (cached)."""
        return self._log.prefix_keys(self.tree, node, first)

    def last_page_key(self, node: TreeNode) -> bytes:
        """The chained key of the last page of the prefix ending at `node` (not the root):
        `page_keys(node)[-1]` without building the whole prefix's list."""
        return self._log.page_keys(self.tree, node)[-1]

    def take_events(self) -> list[KVEvent]:
        """Drain the host-tier events (BlockStored / BlockRemoved with tier `host`)."""
        return [replace(event, tier=HOST_TIER) for event in self._log.drain()]

    # ------------------------------------------------------------------------------------------
    # Reset and integrity
    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every host value (the tree resets itself after). TreeLocked while a host lock
        or a device lock is outstanding."""
        if self._receipts or self.tree.num_locked:
            raise TreeLocked("locks outstanding; unlock them before a reset")
        nodes = self.tree.iter_nodes()
        values = [n.host_value for n in nodes if n.host_value is not None]
        for component in self._extras:
            parts = [slots for n in nodes if (slots := component.take_host(n)) is not None]
            component.free_host(parts)
            component.reset_host()
        for node in nodes:
            node.host_value = None
            node.comp_hosts = None
        self.heap.clear()
        self.candidate_sizes = [0] * len(self.candidate_sizes)
        if values:
            self.host.free(torch.from_numpy(np.concatenate(values)))
        self.evictable_size = self.protected_size = 0
        self._log.drain()
        if self.events_on:
            self._log.cleared()

    def check_integrity(
        self, in_flight: int, components_in_flight: Mapping[str, int] | None = None
    ) -> None:
        """Host free + evictable + protected + `in_flight` == host capacity; both tiers
        prefix-closed; off-device nodes carry a host value; host values cover their node; host
        locks equal the outstanding receipts; the host heap holds exactly the candidates, and
        `candidate_sizes` equal the host slots they hold per component. Per other component
        (`check_host_node`, `check_host_pool`): host copies only beside a host value, device
        data only on the device, no host slot twice, host free + held +
        `components_in_flight[name]` == its host capacity."""
        evictable = protected = 0
        candidates = [0] * len(self.candidate_sizes)
        held: dict[int, list[npt.NDArray[np.int64]]] = {c.index: [] for c in self._extras}
        expected: dict[int, int] = {}
        for receipt in self._receipts.values():
            probe = receipt.anchor
            while probe.parent is not None:
                expected[probe.id] = expected.get(probe.id, 0) + 1
                probe = probe.parent
        for node in self.tree.iter_nodes():
            parent = node.parent
            assert parent is not None
            value = node.host_value
            if len(node.value) and parent.parent is not None and not len(parent.value):
                raise IntegrityError(f"node {node.id} on the device under an off-device parent")
            if value is not None and parent.parent is not None and parent.host_value is None:
                raise IntegrityError(f"node {node.id} on the host under a parent that is not")
            if not len(node.value) and value is None:
                raise IntegrityError(f"node {node.id} is off the device without a host copy")
            if value is not None and len(value) != node.num_tokens:
                raise IntegrityError(f"node {node.id}: {len(value)} host slots")
            if node.host_lock_ref != expected.get(node.id, 0):
                raise IntegrityError(
                    f"node {node.id}: host lock {node.host_lock_ref}, receipts say "
                    f"{expected.get(node.id, 0)}"
                )
            candidate = not len(node.value) and not node.children and node.host_lock_ref == 0
            if (node in self.heap) != candidate:
                raise IntegrityError(f"node {node.id}: host heap membership != {candidate}")
            if value is not None:
                if node.host_lock_ref:
                    protected += len(value)
                else:
                    evictable += len(value)
            for component in self._extras:
                component.check_host_node(node)
                slots = component.host_slots(component.host_value(node))
                if len(slots):
                    held[component.index].append(slots)
                    if candidate:
                        candidates[component.index] += len(slots)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise IntegrityError(
                f"host: counted evictable/protected {evictable}/{protected}, counters say "
                f"{self.evictable_size}/{self.protected_size}"
            )
        free = self.host.available_size()
        if free + evictable + protected + in_flight != self.host.size:
            raise IntegrityError(
                f"host pool: free {free} + evictable {evictable} + protected {protected} + "
                f"in flight {in_flight} != capacity {self.host.size}"
            )
        self.heap.check_integrity()
        if candidates != self.candidate_sizes:
            raise IntegrityError(
                f"host candidates hold {candidates} host slots per component, counters say "
                f"{self.candidate_sizes}"
            )
        flights = components_in_flight or {}
        for component in self._extras:
            component.check_host_pool(held[component.index], flights.get(component.name, 0))
