"""`TierCore`: the state a `HierarchicalCache` shares between its transfer kinds, the routing of
acknowledgements to them, and the host slot allocation every kind uses (host pages, host
states, host SWA slots), each evicting on the host tier when short.

The cache is split by transfer kind along the seams of its life cycle (hierarchy.py):

    tier_core.py      TierCore         shared state, pending records, ack routing, host slots
    tier_writes.py    TierWriter(core) device -> host writes and host -> storage backups
    tier_room.py      DeviceRoom(core, writer)            device slots, eviction by write policy
    tier_prefetch.py  TierPrefetcher(core, writer)        storage -> host prefetches
    tier_loads.py     TierLoader(core, writer, room)      host -> device load-backs (layer-wise)
    hierarchy.py      HierarchicalCache  builds and wires them; match, request life cycle,
                                         integrity

Each is a separate object that gets what it uses through its constructor; none sets another's
attributes.

Every pending record belongs to exactly one transfer in flight and holds exactly one host lock
(see `HierarchicalCache.check_integrity`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    TierController,
)
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.mamba import MambaComponent
from kvstrata.unified_radix_cache.components.swa import SWAComponent
from kvstrata.unified_radix_cache.errors import IntegrityError
from kvstrata.unified_radix_cache.events import KVEvent
from kvstrata.unified_radix_cache.host_tier import HostReceipt, HostTier
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.results import (
    LockReceipt,
)
from kvstrata.unified_radix_cache.tiers import (
    TierCounters,
    TierLoad,
    TierParams,
)
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

FULL = "full"
MAMBA = "mamba"
SWA = "swa"
NO_SLOTS = torch.empty(0, dtype=torch.int64)
# Bound on the finished-but-not-taken prefetch records (an engine that drops a prefetch id
# without finish_prefetch must not grow them forever).
UNTAKEN_PREFETCHES = 1024


@dataclass(kw_only=True, eq=False)
class PendingWrite:
    key: RadixKey
    start: int  # tokens already on the host when submitted
    host_slots: torch.Tensor  # host token slots of key[start:]
    device_receipt: LockReceipt
    host_receipt: HostReceipt
    host_state: torch.Tensor | None = None  # Mamba: the host state slot of the key's end
    host_swa: torch.Tensor | None = None  # SWA: host SWA slots of the key ranges swa_ranges
    swa_ranges: tuple[tuple[int, int], ...] = ()


@dataclass(kw_only=True, eq=False)
class PendingBackup:
    host_receipt: HostReceipt
    keys: list[bytes]
    parent_key: bytes | None
    key: RadixKey
    state_pages: tuple[int, ...] = ()  # Mamba: indices into keys of the pages carrying a state
    swa_pages: tuple[int, ...] = ()  # SWA: indices into keys of the pages with a host SWA copy
    fresh_from: int = 0  # keys[:fresh_from] were stored before (re-sent for their SWA pages)


@dataclass(kw_only=True, eq=False)
class PendingPrefetch:
    key: RadixKey
    start: int
    host_slots: torch.Tensor
    host_receipt: HostReceipt
    committed: int = 0  # tokens of host_slots already handed to the tree
    host_state: int | None = None  # Mamba: host state slot of the key's end, until committed
    state_key: bytes | None = None  # Mamba: the page key whose stored state is fetched
    stopped: bool = False  # finish_prefetch stopped it (a short ack is then no miss)
    taken: bool = False  # finish_prefetch was called for it (no record kept at its ack)
    host_swa: torch.Tensor | None = None  # SWA: host SWA slots of key[swa_from:], until committed
    swa_from: int = 0  # SWA: where the window fetched with the pages starts
    swa_keys: tuple[bytes, ...] = ()  # SWA: the page keys whose stored SWA pages are fetched


@dataclass(kw_only=True, eq=False)
class PendingLoad:
    """A load-back in flight: its device slots are outside the tree until the ack commits them;
    the device prefix it extends and the host pages it reads stay locked until then."""

    key: RadixKey
    start: int
    device_slots: torch.Tensor
    device_receipt: LockReceipt
    host_receipt: HostReceipt
    load: TierLoad
    device_state: torch.Tensor | None = None  # Mamba: the fresh device slot of the state
    swa_from: int = 0  # SWA: key[swa_from:] got its window's SWA pages (before it: tombstone)


Pending = PendingWrite | PendingBackup | PendingPrefetch | PendingLoad
P = TypeVar("P", PendingWrite, PendingBackup, PendingPrefetch, PendingLoad)


def prefix_len(node: TreeNode) -> int:
    total = 0
    probe = node
    while probe.parent is not None:
        total += probe.num_tokens
        probe = probe.parent
    return total


class TierCore:
    """What every transfer kind of a `HierarchicalCache` reads and allocates through: the
    tree and its host tier, the controller, the host allocators, the counters, the records
    of the transfers in flight (`pending`, by op id) and the acknowledgement routing.

    The writer, prefetcher and loader (tier_writes.py, tier_prefetch.py, tier_loads.py) each
    hold this core and register the commit of their own record kind (`route`); `on_ack` pops
    the record an ack names and hands it to that kind. `device_tree` carries a `HostTier`
    (`tier`); `mamba` / `swa` are its state components when it has them.
    """

    def __init__(
        self,
        *,
        device_tree: UnifiedRadixCache,
        tier: HostTier,
        controller: TierController,
        host_allocator: HostSlotAllocator,
        component_hosts: Mapping[str, HostSlotAllocator],
        params: TierParams,
        mamba: MambaComponent | None,
        swa: SWAComponent | None,
    ) -> None:
        full = device_tree.components[0]
        assert isinstance(full, FullComponent), "component 0 of every tree is Full"
        self.params = params
        self.device_tree = device_tree
        self.tier = tier
        self.keyer = tier.keyer
        self.controller = controller
        self.host_allocator = host_allocator
        self.host_state_allocator = component_hosts.get(MAMBA)
        self.host_swa_allocator = component_hosts.get(SWA)
        self.page_size = device_tree.page_size
        self.device_full = full
        self.mamba = mamba
        self.swa = swa
        group = controller.group
        self.page_bytes = group.page_bytes(FULL)
        self.state_bytes = 0 if mamba is None else group.page_bytes(MAMBA)
        self.swa_page_bytes = 0 if swa is None else group.page_bytes(SWA)
        self.backups = params.backup_to_storage and controller.storage is not None
        self.counters = TierCounters()
        self.pending: dict[int, Pending] = {}
        #: Storage events (BlockStored with tier `storage`) not yet taken.
        self.events: list[KVEvent] = []
        #: Backups started while `poll` commits a run of acks, sent together at its end; None
        #: outside `poll` (a backup is then submitted at once).
        self.held_backups: list[tuple[BackupOp, PendingBackup]] | None = None
        #: Mamba / SWA + storage: page keys whose boundary state (Mamba) or SWA page (SWA) a
        #: backup stored (oldest first, at most `params.known_stored_states`). The nodes that
        #: held them may have left the tree since, and storage can only say whether a run of
        #: keys exists from the first one, so this is how a prefetch picks the boundary whose
        #: state or window to fetch. An entry storage no longer holds costs one empty
        #: prefetch, which drops it.
        self.stored_states: OrderedDict[bytes, None] = OrderedDict()
        self._routes: dict[type, Callable[[Pending, Ack], None]] = {}

    def route(self, kind: type[P], commit: Callable[[P, Ack], None]) -> None:
        """Acks of transfers with pending records of `kind` go to `commit`."""
        self._routes[kind] = cast("Callable[[Pending, Ack], None]", commit)

    def on_ack(self, ack: Ack) -> None:
        """Commit one acknowledgement: pop its record and hand it to its kind's commit (a
        failed ack of a write, backup or prefetch counts in `failed_ops` first; a load counts
        its own). An ack of no record in flight is ignored."""
        pending = self.pending.pop(ack.op_id, None)
        if pending is None:
            return
        if ack.status is AckStatus.FAILED and not isinstance(pending, PendingLoad):
            self.counters.failed_ops += 1
        self._routes[type(pending)](pending, ack)

    def poll(self) -> None:
        """Commit every finished transfer: writes give their nodes host values (and start
        their storage backup), prefetches add host values as far as they arrived, loads give
        their nodes device slots again, backups flag stored nodes; failed ones release what
        they held. Never blocks."""
        if not self.pending:
            return
        acks = self.controller.poll_acks()
        if not acks:
            return
        # Backups the write acks start go to the controller together (one worker wake-up).
        held: list[tuple[BackupOp, PendingBackup]] = []
        self.held_backups = held
        try:
            for ack in acks:
                self.on_ack(ack)
        finally:
            self.held_backups = None
            self._send_backups(held)

    def _send_backups(self, held: list[tuple[BackupOp, PendingBackup]]) -> None:
        """Submit the backups `poll` held back, with one wake-up of the backup worker; one the
        queue has no room for is dropped (its host lock released), as `_backup` does."""
        if not held:
            return
        op_ids = self.controller.submit_backups([op for op, _ in held])
        for (_, pending), op_id in zip(held, op_ids, strict=True):
            if op_id is None:
                self.tier.unlock(pending.host_receipt)
            else:
                self.pending[op_id] = pending

    def check_pending(self) -> None:
        """The pending records hold exactly the host tier's outstanding receipts (by id), and
        no host page slot, host state slot or host SWA slot is held twice: node host values
        plus what transfers hold outside the tree (a write's slots, a prefetch's uncommitted
        ones). Raises IntegrityError. O(nodes + slots log slots)."""
        held = sorted(p.host_receipt.receipt_id for p in self.pending.values())
        outstanding = sorted(self.tier.receipt_ids())
        if held != outstanding:
            raise IntegrityError(
                f"pending transfers hold host receipts {held}, the host tier has {outstanding}"
            )
        pages: list[npt.NDArray[np.int64]] = []
        states: list[int] = []
        swa: list[npt.NDArray[np.int64]] = []
        mamba, swa_component = self.mamba, self.swa
        for node in self.device_tree.iter_nodes():
            if node.host_value is not None:
                pages.append(node.host_value)
            if mamba is not None and (slot := mamba.host_slot(node)) is not None:
                states.append(slot)
            if swa_component is not None and (copy := swa_component.host_copy(node)) is not None:
                swa.append(copy)
        for p in self.pending.values():
            if isinstance(p, PendingWrite):
                pages.append(p.host_slots.numpy())
                if p.host_state is not None:
                    states.extend(int(s) for s in p.host_state.tolist())
            elif isinstance(p, PendingPrefetch):
                pages.append(p.host_slots[p.committed :].numpy())
                if p.host_state is not None:
                    states.append(p.host_state)
            else:
                continue
            if p.host_swa is not None:
                swa.append(p.host_swa.numpy())
        for name, parts in (("host page", pages), ("host SWA", swa)):
            slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            if len(np.unique(slots)) != len(slots):
                raise IntegrityError(f"a {name} slot is held twice (nodes and transfers)")
        if len(set(states)) != len(states):
            raise IntegrityError("a host state slot is held twice (nodes and transfers)")

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host tokens (or all that may go), in the host policy's
        order: host copies of nodes off the device, childless and not locked by a transfer;
        each such node leaves the tree (storage keeps its pages). A copy of a prefix the device
        still holds never goes (it is what makes a later device eviction free). Returns the
        tokens freed. Cost: O(k log n)."""
        freed = self.tier.evict(num_tokens)
        self.counters.host_evicted_tokens += freed
        return freed

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

    def alloc_host_state(self) -> torch.Tensor | None:
        """One host state slot; when the pool is out, host-evicts (in the host policy's order)
        only off-device nodes holding a host state, and only when one of them can go (see
        `HostTier.evict_for`). None, with nothing evicted, when none can."""
        allocator = self.host_state_allocator
        assert allocator is not None, "host states in a tree without Mamba"
        slot = allocator.alloc(1)
        if slot is None:
            assert self.mamba is not None
            freed = self.tier.evict_for(self.mamba, 1 - allocator.available_size())
            self.counters.host_evicted_tokens += freed.tokens
            slot = allocator.alloc(1) if freed.slots else None
        return slot

    def alloc_host_swa(self, num_tokens: int) -> torch.Tensor | None:
        """Host SWA slots; when the pool is short, host-evicts (in the host policy's order)
        only off-device nodes holding host SWA slots, and only when together they hold enough
        (see `HostTier.evict_for`). None, with nothing evicted, when they do not: the host
        SWA pool is then held by copies of nodes still on the device (or by transfers)."""
        allocator = self.host_swa_allocator
        assert allocator is not None, "host SWA slots in a tree without SWA"
        slots = allocator.alloc(num_tokens)
        if slots is None:
            assert self.swa is not None
            freed = self.tier.evict_for(self.swa, num_tokens - allocator.available_size())
            self.counters.host_evicted_tokens += freed.tokens
            slots = allocator.alloc(num_tokens) if freed.slots else None
        return slots

    def free_host_swa(self, slots: torch.Tensor) -> None:
        assert self.host_swa_allocator is not None, "host SWA slots in a tree without SWA"
        self.host_swa_allocator.free(slots)

    def window_pages(self) -> int:
        """SWA trees: the pages the sliding window spans (whole pages)."""
        assert self.swa is not None, "_window_pages on a tree without SWA"
        return -(-self.swa.sliding_window // self.page_size)

    def commit_host_swa(
        self,
        node: TreeNode,
        end: int,
        ranges: tuple[tuple[int, int], ...],
        host_swa: torch.Tensor,
    ) -> None:
        """Give the nodes covering the key `ranges` (on the path ending at `node`, at `end`)
        their slices of `host_swa`; a node that has host SWA slots already keeps them and the
        new ones go back to the allocator. Ranges are node runs (nodes only split since)."""
        values = host_swa.numpy()
        offsets: list[int] = []
        base = 0
        for lo, hi in ranges:
            offsets.append(base)
            base += hi - lo
        k = len(ranges) - 1
        pos, probe = end, node
        while k >= 0 and probe.parent is not None:
            first = pos - probe.num_tokens
            lo, hi = ranges[k]
            if first < hi:
                assert lo <= first and pos <= hi, (
                    f"host SWA commit: node {probe.id} straddles the range {lo}..{hi}"
                )
                at = offsets[k] + first - lo
                part = values[at : at + probe.num_tokens].copy()
                assert self.swa is not None
                if not self.tier.set_host(self.swa, probe, part):
                    self.free_host_swa(torch.from_numpy(part))
                if first == lo:
                    k -= 1
            pos = first
            probe = probe.parent
        assert k < 0, "host SWA commit: the ranges run past the root"

    def free_host_state(self, slot: torch.Tensor) -> None:
        assert self.host_state_allocator is not None, "host states in a tree without Mamba"
        self.host_state_allocator.free(slot)
