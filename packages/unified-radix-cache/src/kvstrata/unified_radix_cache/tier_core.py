"""`TierCore`: the state a `HierarchicalCache` shares between its transfer kinds, and the slot
allocation every kind uses (host pages, host states, host SWA slots, device slots), each
evicting on its own tier when short.

The cache is split by transfer kind along the seams of its life cycle (hierarchy.py):

    tier_core.py      TierCore       shared state, pending records, slot allocation, host eviction
    tier_writes.py    TierWrites     device -> host writes and host -> storage backups
    tier_prefetch.py  TierPrefetches storage -> host prefetches
    tier_loads.py     TierLoads      host -> device load-backs (layer-wise)
    hierarchy.py      HierarchicalCache  match, request life cycle, eviction, acks, integrity

Every pending record belongs to exactly one transfer in flight and holds exactly one host lock
(see `HierarchicalCache.check_integrity`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.hybrid_cache import (
    Ack,
    BackupOp,
    TierController,
    WriteOp,
)
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.mamba import MambaComponent
from kvstrata.unified_radix_cache.components.swa import SWAComponent
from kvstrata.unified_radix_cache.errors import IntegrityError
from kvstrata.unified_radix_cache.events import KVEvent
from kvstrata.unified_radix_cache.host_tier import HostReceipt, HostTier
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.results import (
    EvictRequest,
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


def prefix_len(node: TreeNode) -> int:
    total = 0
    probe = node
    while probe.parent is not None:
        total += probe.num_tokens
        probe = probe.parent
    return total


class TierCore(ABC):
    """What every transfer kind of a `HierarchicalCache` reads and allocates through. The
    attributes are set by `HierarchicalCache.__init__`."""

    params: TierParams
    device_tree: UnifiedRadixCache
    controller: TierController
    host_allocator: HostSlotAllocator
    host_state_allocator: HostSlotAllocator | None
    host_swa_allocator: HostSlotAllocator | None
    page_size: int
    tier: HostTier
    keyer: PageKeyer
    counters: TierCounters
    _device_full: FullComponent
    _mamba: MambaComponent | None
    _swa: SWAComponent | None
    _page_bytes: int
    _state_bytes: int
    _swa_page_bytes: int
    _backups: bool
    _pending: dict[int, Pending]
    # Writes queued for the next batch (tier_writes.py): temporary id (negative, also the key
    # of their record in `_pending`) and the op to submit.
    _unsent: list[tuple[int, WriteOp]]
    _unsent_ids: int
    # Backups started while `poll` commits a run of acks (tier_writes.py), sent together at
    # its end; None outside `poll` (a backup is then submitted at once).
    _held_backups: list[tuple[BackupOp, PendingBackup]] | None
    # Requests begun so far, and how many had begun when the oldest queued write was queued
    # (a queue that waited `write_batch` requests is sent even when short of a batch).
    _num_requests: int
    _unsent_since: int
    _events: list[KVEvent]
    _stored_states: OrderedDict[bytes, None]
    # Prefetches a poll committed before their finish_prefetch: op id -> tokens committed,
    # oldest first, at most UNTAKEN_PREFETCHES (dropped when finish_prefetch takes them).
    _untaken_prefetches: OrderedDict[int, int]

    @abstractmethod
    def evict_device(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (see `HierarchicalCache.evict_device`)."""

    @abstractmethod
    def _flush_writes(self) -> dict[int, int]:
        """Submit the queued host writes (see `TierWrites._flush_writes`)."""

    @abstractmethod
    def _on_ack(self, ack: Ack) -> None:
        """Commit one acknowledgement (see `HierarchicalCache._on_ack`)."""

    def _check_pending(self) -> None:
        """The pending records hold exactly the host tier's outstanding receipts (by id), and
        no host page slot, host state slot or host SWA slot is held twice: node host values
        plus what transfers hold outside the tree (a write's slots, a prefetch's uncommitted
        ones). Raises IntegrityError. O(nodes + slots log slots)."""
        held = sorted(p.host_receipt.receipt_id for p in self._pending.values())
        outstanding = sorted(self.tier.receipt_ids())
        if held != outstanding:
            raise IntegrityError(
                f"pending transfers hold host receipts {held}, the host tier has {outstanding}"
            )
        pages: list[npt.NDArray[np.int64]] = []
        states: list[int] = []
        swa: list[npt.NDArray[np.int64]] = []
        mamba, swa_component = self._mamba, self._swa
        for node in self.device_tree.iter_nodes():
            if node.host_value is not None:
                pages.append(node.host_value)
            if mamba is not None and (slot := mamba.host_slot(node)) is not None:
                states.append(slot)
            if swa_component is not None and (copy := swa_component.host_copy(node)) is not None:
                swa.append(copy)
        for p in self._pending.values():
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

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

    def _alloc_host_state(self) -> torch.Tensor | None:
        """One host state slot; when the pool is out, host-evicts (in the host policy's order)
        only off-device nodes holding a host state, and only when one of them can go (see
        `HostTier.evict_for`). None, with nothing evicted, when none can."""
        allocator = self.host_state_allocator
        assert allocator is not None, "host states in a tree without Mamba"
        slot = allocator.alloc(1)
        if slot is None:
            assert self._mamba is not None
            freed = self.tier.evict_for(self._mamba, 1 - allocator.available_size())
            self.counters.host_evicted_tokens += freed.tokens
            slot = allocator.alloc(1) if freed.slots else None
        return slot

    def _alloc_host_swa(self, num_tokens: int) -> torch.Tensor | None:
        """Host SWA slots; when the pool is short, host-evicts (in the host policy's order)
        only off-device nodes holding host SWA slots, and only when together they hold enough
        (see `HostTier.evict_for`). None, with nothing evicted, when they do not: the host
        SWA pool is then held by copies of nodes still on the device (or by transfers)."""
        allocator = self.host_swa_allocator
        assert allocator is not None, "host SWA slots in a tree without SWA"
        slots = allocator.alloc(num_tokens)
        if slots is None:
            assert self._swa is not None
            freed = self.tier.evict_for(self._swa, num_tokens - allocator.available_size())
            self.counters.host_evicted_tokens += freed.tokens
            slots = allocator.alloc(num_tokens) if freed.slots else None
        return slots

    def _free_host_swa(self, slots: torch.Tensor) -> None:
        assert self.host_swa_allocator is not None, "host SWA slots in a tree without SWA"
        self.host_swa_allocator.free(slots)

    def _window_pages(self) -> int:
        """SWA trees: the pages the sliding window spans (whole pages)."""
        assert self._swa is not None, "_window_pages on a tree without SWA"
        return -(-self._swa.sliding_window // self.page_size)

    def _commit_host_swa(
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
                assert self._swa is not None
                if not self.tier.set_host(self._swa, probe, part):
                    self._free_host_swa(torch.from_numpy(part))
                if first == lo:
                    k -= 1
            pos = first
            probe = probe.parent
        assert k < 0, "host SWA commit: the ranges run past the root"

    def _free_host_state(self, slot: torch.Tensor) -> None:
        assert self.host_state_allocator is not None, "host states in a tree without Mamba"
        self.host_state_allocator.free(slot)

    def _alloc_device_state(self) -> torch.Tensor | None:
        """One device state slot, evicting an unlocked device state when the pool is out."""
        mamba = self._mamba
        assert mamba is not None, "device states in a tree without Mamba"
        slot = mamba.allocator.alloc(1)
        if slot is None:
            self.device_tree.evict(EvictRequest(targets={MAMBA: 1}))
            slot = mamba.allocator.alloc(1)
        return slot

    def _give_back_state(self, slot: torch.Tensor) -> None:
        assert self._mamba is not None, "device states in a tree without Mamba"
        self._mamba.give_back(slot)

    def _alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Device KV slots, evicting when short: Full through the write policy
        (`evict_device`), then every other token component (SWA, allocated in step) its own
        shortfall. None when even that leaves no room."""
        allocator = self._device_full.allocator
        alloc = getattr(allocator, "alloc", None)
        assert alloc is not None, "the device tree's allocator must allocate (SlotSource)"
        slots = alloc(num_tokens)
        if not isinstance(slots, torch.Tensor):
            short = num_tokens - self._device_full.free_size()
            if short > 0:
                self.evict_device(short)
            rest = {
                c.name: num_tokens - free
                for c in self.device_tree.components[1:]
                if c.unit == "tokens" and (free := c.free_size()) < num_tokens
            }
            if rest:
                self.device_tree.evict(EvictRequest(targets=rest))
            slots = alloc(num_tokens)
        return slots if isinstance(slots, torch.Tensor) else None
