"""`MambaComponent`: the recurrent state of SSM (Mamba) layers, one state slot per node at most.

A state summarises the whole prefix up to the end of its node, so it cannot be sliced: a split
leaves it on the lower half (which still ends where the state does) and the new parent gets
none. A match may end only at a node with a state; with `copy_state` the match copies that
state into a fresh slot the request owns (copy-on-write through `MambaPool.copy`), so the
cached state is never advanced in place. A lock protects the anchor's state only. Eviction runs
its own LRU list over unlocked states: an internal node becomes a tombstone, a leaf goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvstrata.allocator.errors import NotAllocated
from kvstrata.unified_radix_cache.components.base import (
    ComponentInsert,
    LRUListComponent,
    SlotSink,
)
from kvstrata.unified_radix_cache.components.transfer import (
    ComponentTransfer,
    TierAccess,
    TransferLeg,
    runs_back,
)
from kvstrata.unified_radix_cache.errors import (
    IntegrityError,
    InvalidInsert,
    SlotNotAllocated,
    StateSlotsExhausted,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.results import LockReceipt


class StateSlotSource(SlotSink, Protocol):
    """What MambaComponent needs of `kvstrata.allocator.MambaSlotAllocator`: a slot sink it
    can also allocate from."""

    def alloc(self, need_size: int, /) -> torch.Tensor | None: ...


class StateCopier(Protocol):
    """What MambaComponent needs of `kvstrata.pool.MambaPool`."""

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, /) -> None: ...


@dataclass(frozen=True, kw_only=True)
class MambaInsert(ComponentInsert):
    """The state slot holding the state after the inserted key's last token. The tree adopts it
    (InsertResult.adopted_states names "mamba") unless the node already has a state."""

    slot: int


class MambaComponent(LRUListComponent):
    """Mamba state slots from `allocator`, copied within `pool` on copy-on-write."""

    name = "mamba"
    priority = 0
    unit = "states"

    def __init__(self, allocator: StateSlotSource, pool: StateCopier) -> None:
        super().__init__(allocator.device)
        self.allocator = allocator
        self.pool = pool
        #: Copy-on-write copies made by matches (a counter for metrics).
        self.copies_total = 0
        self._transfer = MambaTransfer(self)

    def capacity(self) -> int:
        return int(self.allocator.size)

    def free_size(self) -> int:
        return int(self.allocator.available_size())

    def node_size(self, node: TreeNode) -> int:
        assert node.comp_values is not None
        return 0 if node.comp_values[self.index] is None else 1

    def slot(self, node: TreeNode) -> int | None:
        """The state slot on `node`, or None."""
        assert node.comp_values is not None
        value = node.comp_values[self.index]
        assert value is None or isinstance(value, int)
        return value

    # -- match ------------------------------------------------------------------------------
    def match_end(self, path: list[TreeNode]) -> int:
        i = self.index
        for k in range(len(path), 0, -1):
            values = path[k - 1].comp_values
            assert values is not None
            if values[i] is not None:
                return k
        return 0

    def finalize_match(self, node: TreeNode, copy_state: bool) -> torch.Tensor | None:
        """Copy the matched state into a new slot (evicting another unlocked state when the
        allocator is out). Raises StateSlotsExhausted before copying or allocating anything
        when no slot can be had."""
        if not copy_state or node.parent is None:
            return None
        src = self.slot(node)
        if src is None:
            return None
        assert node.comp_locks is not None
        own_unlocked = 1 if node.comp_locks[self.index] == 0 else 0
        if self.allocator.available_size() < 1 and self.evictable_size - own_unlocked < 1:
            raise StateSlotsExhausted(
                "no free Mamba state slot and no unlocked state to evict besides the matched one"
            )
        dst = self.allocator.alloc(1)
        if dst is None:
            # Keep the matched state out of reach while making room for its copy.
            self.lock_node(node, 1)
            try:
                self.evict(1)
                self.tree.flush_pending()
            finally:
                self.unlock_node(node, 1)
            dst = self.allocator.alloc(1)
            assert dst is not None, "MambaComponent: eviction freed a slot but alloc failed"
        self.pool.copy(torch.tensor([src], dtype=torch.int64, device=self.device), dst)
        self.copies_total += 1
        return dst

    # -- structure ------------------------------------------------------------------------
    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        # The state belongs to the end of the run, which `lower` keeps; `upper` starts empty.
        pass

    def check_insert_input(self, inp: ComponentInsert, num_tokens: int) -> None:
        if not isinstance(inp, MambaInsert):
            raise InvalidInsert(f"the mamba input must be a MambaInsert, got {type(inp).__name__}")
        if num_tokens == 0 or num_tokens % self.tree.page_size:
            raise InvalidInsert(
                f"a Mamba state needs a key of whole pages (state after its last token); "
                f"got {num_tokens} tokens with page size {self.tree.page_size}"
            )
        if not 0 < inp.slot <= self.capacity():
            raise InvalidInsert(f"Mamba slot {inp.slot} outside 1..{self.capacity()}")
        check = getattr(self.allocator, "check_allocated", None)
        if self.tree.check_slots and callable(check):
            try:
                check(torch.tensor([int(inp.slot)], device=self.device), "insert mamba slot")
            except NotAllocated as e:
                raise SlotNotAllocated(str(e)) from None

    def on_insert_commit(self, node: TreeNode, inp: ComponentInsert | None) -> bool:
        if not isinstance(inp, MambaInsert) or node.parent is None:
            return False
        assert node.comp_values is not None
        if node.comp_values[self.index] is not None:
            return False  # already has the state for this prefix: the caller frees its copy
        node.comp_values[self.index] = int(inp.slot)
        self.evictable_size += 1
        self.lru.touch(node)
        return True

    # -- host tier ----------------------------------------------------------------------------
    def host_slot(self, node: TreeNode) -> int | None:
        """The host state slot on `node` (the state at the end of its run), or None."""
        value = self.host_value(node)
        assert value is None or isinstance(value, int)
        return value

    def host_hit_may_end(self, node: TreeNode) -> bool:
        """A host hit ends only where the host holds the state at the end of the node."""
        return self.host_value(node) is not None

    def tier_transfer(self) -> MambaTransfer:
        return self._transfer

    # -- eviction -------------------------------------------------------------------------
    def release(self, node: TreeNode, node_goes: bool) -> int:
        i = self.index
        assert node.comp_values is not None and node.comp_locks is not None
        assert node.comp_locks[i] == 0, f"MambaComponent: releasing locked state on node {node.id}"
        slot = node.comp_values[i]
        assert isinstance(slot, int), f"MambaComponent: no state on node {node.id}"
        node.comp_values[i] = None
        self.evictable_size -= 1
        self.lru.discard(node)
        self._pending.append(np.array([slot], dtype=np.int64))
        return 1

    def give_back(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    # -- locking ----------------------------------------------------------------------------
    def lock(self, anchor: TreeNode) -> int | None:
        """Lock the anchor's state only. Boundary: 1, or None when the anchor has no state."""
        if anchor.parent is None or self.slot(anchor) is None:
            return None
        self.lock_node(anchor, 1)
        return 1

    def unlock(self, anchor: TreeNode, boundary: int | None) -> None:
        if boundary is not None:
            self.unlock_node(anchor, 1)

    # -- integrity ------------------------------------------------------------------------
    def check_node(self, node: TreeNode) -> None:
        self.check_listed(node, self.slot(node) is not None)

    def check_locks(self, receipts: Iterable[LockReceipt]) -> None:
        i = self.index
        expected: dict[int, int] = {}
        for receipt in receipts:
            if receipt.boundaries[i] is not None:
                expected[receipt.anchor.id] = expected.get(receipt.anchor.id, 0) + 1
        self.check_lock_counts(expected)
        slots = [self.slot(n) for n in self.tree.iter_nodes() if self.slot(n) is not None]
        if len(slots) != len(set(slots)):
            raise IntegrityError("two nodes share one Mamba state slot")


class MambaTransfer(ComponentTransfer):
    """The tier hooks of a `MambaComponent` (member "mamba" of the pool group, host pool of
    page size 1: one host state slot per entry): the state at the end of a node's run moves
    with the pages that end there.

    - write: the device state of the node the write ends at, when the host has none for it;
    - backup: each node's host state beside the page at the node's end; every stored one is a
      boundary a prefetch may end at;
    - prefetch: only up to the deepest page whose state a backup stored, plus that state;
    - load: the host state at the load's end into a fresh device state slot (evicting another
      unlocked device state when the pool is out), adopted by the tree through `MambaInsert`.
    """

    gauge = ("host_states", "Host tier Mamba state slots by state (Mamba models only).")

    def __init__(self, component: MambaComponent) -> None:
        self.component = component
        self.name = component.name

    def plan_write(self, tiers: TierAccess, node: TreeNode, end: int) -> TransferLeg | None:
        mamba = self.component
        if mamba.slot(node) is None or mamba.host_slot(node) is not None:
            return None
        return TransferLeg(name=self.name, size=1)

    def write_source(self, tiers: TierAccess, node: TreeNode, leg: TransferLeg) -> torch.Tensor:
        slot = self.component.slot(node)
        assert slot is not None, f"Mamba write from node {node.id} without a device state"
        return torch.tensor([slot], dtype=torch.int64)

    def commit_write(self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, end: int) -> None:
        host = leg.host
        assert host is not None
        if not tiers.set_host(self.name, node, int(host.item())):
            tiers.free_component_host(self.name, host)

    def backup_pages(
        self, tiers: TierAccess, node: TreeNode, first: int, num_keys: int
    ) -> list[int | None]:
        """Each node of the range with a host state stores it beside its last page."""
        page = tiers.page_size
        states: list[int | None] = [None] * (num_keys - first)
        for probe, _, end in runs_back(node, first * page, num_keys * page):
            slot = self.component.host_slot(probe)
            if slot is not None:
                states[end // page - 1 - first] = slot
        return states

    def prefetch_pages(
        self, tiers: TierAccess, anchor: TreeNode, start: int, keys: Sequence[bytes]
    ) -> int:
        return next((i + 1 for i in range(len(keys) - 1, -1, -1) if tiers.knows_stored(keys[i])), 0)

    def plan_prefetch(self, tiers: TierAccess, start: int, keys: Sequence[bytes]) -> TransferLeg:
        return TransferLeg(name=self.name, size=1, first=len(keys) - 1, keys=(keys[-1],))

    def plan_load(self, tiers: TierAccess, node: TreeNode, start: int, end: int) -> TransferLeg:
        """The host state of `node` when the device has none there."""
        mamba = self.component
        host = mamba.host_slot(node) if mamba.slot(node) is None else None
        if host is None:
            return TransferLeg(name=self.name)
        return TransferLeg(name=self.name, size=1, host=torch.tensor([host], dtype=torch.int64))

    def alloc_device(self, tiers: TierAccess, leg: TransferLeg) -> torch.Tensor | None:
        allocator = self.component.allocator
        slot = allocator.alloc(leg.size)
        if slot is None:
            tiers.evict_device_component(self.name, leg.size)
            slot = allocator.alloc(leg.size)
        return slot

    def load_move(
        self, tiers: TierAccess, leg: TransferLeg, node: TreeNode, device: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if leg.device is None or leg.host is None:
            return None
        return leg.device, leg.host

    def load_input(self, leg: TransferLeg) -> ComponentInsert | None:
        return None if leg.device is None else MambaInsert(slot=int(leg.device.item()))
