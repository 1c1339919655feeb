"""`TierCore`: the state a `HierarchicalCache` shares between its transfer kinds, the routing of
acknowledgements to them, and the host slot allocation every kind uses (host pages, and the
host slots of each other component), each evicting on the host tier when short.

Every transfer moves Full pages itself and asks each other component for its part through the
component's `ComponentTransfer` hooks (components/transfer.py); `TierCore` is the `TierAccess`
those hooks call back into. No module here names a model family.

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
from typing import NamedTuple, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    PagePairs,
    TierController,
)
from kvstrata.pool_host import HostSlotAllocator, vouched_pages
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.transfer import ComponentTransfer, TransferLeg
from kvstrata.unified_radix_cache.errors import IntegrityError
from kvstrata.unified_radix_cache.events import KVEvent
from kvstrata.unified_radix_cache.host_tier import HostReceipt, HostTier
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
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
NO_SLOTS = torch.empty(0, dtype=torch.int64)
#: No host slots (a write that moves only other components' parts); never written to.
NO_HOST_SLOTS: npt.NDArray[np.int64] = NO_SLOTS.numpy()
# Bound on the finished-but-not-taken prefetch records (an engine that drops a prefetch id
# without finish_prefetch must not grow them forever).
UNTAKEN_PREFETCHES = 1024


class MoveLocks(NamedTuple):
    """The two locks a write or a load holds until its ack (`TierCore.lock_move`): the device
    prefix ending at the node the pages move from or to (`device`) and the host prefix they
    extend or are read from (`host`)."""

    device: LockReceipt
    host: HostReceipt


@dataclass(kw_only=True, eq=False)
class PendingMove:
    """What a write and a load in flight share: `key[start:]` moves between the device and
    the host, both prefixes locked (`locks`) until the ack, with the other components' parts
    (`legs`, in tree order: the host slots each took for a write, the device slots for a
    load)."""

    key: RadixKey
    start: int  # tokens of the key already at the destination when submitted
    locks: MoveLocks
    legs: tuple[TransferLeg, ...] = ()

    @property
    def device_receipt(self) -> LockReceipt:
        return self.locks.device

    @property
    def host_receipt(self) -> HostReceipt:
        return self.locks.host

    @host_receipt.setter
    def host_receipt(self, receipt: HostReceipt) -> None:
        self.locks = self.locks._replace(host=receipt)


@dataclass(kw_only=True, eq=False)
class PendingWrite(PendingMove):
    #: Host token slots of key[start:], as the NumPy array of the allocator's tensor (the
    #: write reads them as page ids and the commit as node values: no tensor round trip).
    host_slots: npt.NDArray[np.int64]


@dataclass(kw_only=True, eq=False)
class PendingBackup:
    host_receipt: HostReceipt
    keys: list[bytes]
    parent_key: bytes | None
    key: RadixKey
    #: Per other component (by name): indices into keys of the pages stored with its page.
    comp_pages: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fresh_from: int = 0  # keys[:fresh_from] were stored before (re-sent for their other pages)


@dataclass(kw_only=True, eq=False)
class PendingPrefetch:
    key: RadixKey
    start: int
    host_slots: torch.Tensor
    host_receipt: HostReceipt
    committed: int = 0  # tokens of host_slots already handed to the tree
    stopped: bool = False  # finish_prefetch stopped it (a short ack is then no miss)
    taken: bool = False  # finish_prefetch was called for it (no record kept at its ack)
    #: The other components' parts, until committed (once every page arrived).
    legs: tuple[TransferLeg, ...] = ()
    #: The chained page keys of key[start:], one per page: the nodes the prefetch adds take
    #: theirs from here instead of hashing them again.
    keys: tuple[bytes, ...] = ()


@dataclass(kw_only=True, eq=False)
class PendingLoad(PendingMove):
    """A load-back in flight: its device slots are outside the tree until the ack commits them;
    the device prefix it extends and the host pages it reads stay locked until then."""

    device_slots: torch.Tensor
    load: TierLoad


Pending = PendingWrite | PendingBackup | PendingPrefetch | PendingLoad
P = TypeVar("P", PendingWrite, PendingBackup, PendingPrefetch, PendingLoad)


def run_above(node: TreeNode, num_tokens: int, *, host: bool = False) -> npt.NDArray[np.int64]:
    """The last `num_tokens` Full slots of the prefix ending at `node`: its device slots, or
    with `host` its host slots (every node walked must then have a host value). One NumPy
    array (a view when one node holds them all); the walk stops as soon as they are covered,
    and no tensor is made (a torch slice of the whole prefix costs more than the walk)."""
    parts: list[npt.NDArray[np.int64]] = []
    got = 0
    probe = node
    while got < num_tokens:
        value = probe.host_value if host else probe.value
        assert value is not None and probe.parent is not None, "the prefix is shorter"
        parts.append(value)
        got += len(value)
        probe = probe.parent
    if not parts:
        return NO_SLOTS.numpy()
    run = parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])
    return run[got - num_tokens :]


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
    (`tier`); `transfers` are the tier hooks of its other components (by name, tree order),
    and `TierCore` is the `TierAccess` they call.
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
    ) -> None:
        full = device_tree.components[0]
        assert isinstance(full, FullComponent), "component 0 of every tree is Full"
        self.params = params
        self.device_tree = device_tree
        self.tier = tier
        self.keyer = tier.keyer
        self.controller = controller
        self.host_allocator = host_allocator
        self.component_hosts = dict(component_hosts)
        self.page_size = device_tree.page_size
        self.device_full = full
        #: The other components (by name) and their tier hooks, in tree order.
        self.components = {c.name: c for c in device_tree.components[1:]}
        transfers: dict[str, ComponentTransfer] = {}
        for name, component in self.components.items():
            transfer = component.tier_transfer()
            assert transfer is not None, f"component {name!r} has no tier hooks"
            transfers[name] = transfer
        self.transfers = transfers
        group = controller.group
        self.page_bytes = group.page_bytes(FULL)
        #: Slots per page of each member's pools (what page ids of a write are counted in).
        self.member_pages = {name: group.member(name).host.page_size for name in group.member_names}
        self.full_page = self.member_pages[FULL]
        #: Per other component: bytes of one page of its host pool, and its host page size.
        self.comp_page_bytes = {name: group.page_bytes(name) for name in transfers}
        self.comp_page_tokens = {name: a.page_size for name, a in self.component_hosts.items()}
        self.backups = params.backup_to_storage and controller.storage is not None
        self.counters = TierCounters()
        self.pending: dict[int, Pending] = {}
        #: How many of `pending` are writes queued and not yet submitted (under a temporary
        #: negative id, tier_writes.py): no ack can come for them, so `poll` skips the
        #: controller when they are all there is.
        self.num_unsent = 0
        #: Storage events (BlockStored with tier `storage`) not yet taken.
        self.events: list[KVEvent] = []
        #: Backups started while `poll` commits a run of acks, sent together at its end; None
        #: outside `poll` (a backup is then submitted at once).
        self.held_backups: list[tuple[BackupOp, PendingBackup]] | None = None
        #: Other components + storage: page keys a backup stored a component's page beside
        #: that a prefetch may end at (`ComponentTransfer.remembered`; e.g. a Mamba boundary
        #: state, the last window's SWA pages), oldest first, at most
        #: `params.known_stored_states`. The nodes that held them may have left the tree since,
        #: and storage can only say whether a run of keys exists from the first one, so this is
        #: how a prefetch picks the boundary to fetch. An entry storage no longer holds costs
        #: one empty prefetch, which drops it.
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
        if len(self.pending) == self.num_unsent:
            return  # nothing submitted is in flight
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
        # A CPU controller runs them on this thread: a backup worker's GIL hand-offs cost more
        # than the copies (`TierController.runs_inline`).
        # Trusted: the tier's own host pages and page keys (`TierWriter.flush` has the why).
        op_ids = self.controller.submit_backups([op for op, _ in held], inline=True, trusted=True)
        for (_, pending), op_id in zip(held, op_ids, strict=True):
            if op_id is None:
                self.tier.unlock(pending.host_receipt)
            else:
                self.pending[op_id] = pending

    def check_pending(self) -> None:
        """The pending records hold exactly the host tier's outstanding receipts (by id),
        `num_unsent` counts those under a temporary id, and no host page slot, nor host slot
        of another component, is held twice: node host values plus what transfers hold outside
        the tree (a write's slots, a prefetch's uncommitted ones). Raises IntegrityError.
        O(nodes + slots log slots)."""
        queued = sum(1 for op_id in self.pending if op_id < 0)
        if queued != self.num_unsent:
            raise IntegrityError(
                f"{queued} pending writes wait unsent (temporary ids), {self.num_unsent} counted"
            )
        held = sorted(p.host_receipt.receipt_id for p in self.pending.values())
        outstanding = sorted(self.tier.receipt_ids())
        if held != outstanding:
            raise IntegrityError(
                f"pending transfers hold host receipts {held}, the host tier has {outstanding}"
            )
        pages: list[npt.NDArray[np.int64]] = []
        parts: dict[str, list[npt.NDArray[np.int64]]] = {name: [] for name in self.components}
        components = tuple(self.components.values())
        for node in self.device_tree.iter_nodes():
            if node.host_value is not None:
                pages.append(node.host_value)
            for component in components:
                slots = component.host_slots(component.host_value(node))
                if len(slots):
                    parts[component.name].append(slots)
        for p in self.pending.values():
            if isinstance(p, PendingWrite):
                pages.append(p.host_slots)
            elif isinstance(p, PendingPrefetch):
                pages.append(p.host_slots[p.committed :].numpy())
            else:
                continue
            for leg in p.legs:
                if leg.host is not None:
                    parts[leg.name].append(leg.host.numpy())
        for name, found in (("host page", pages), *((f"host {n}", v) for n, v in parts.items())):
            slots = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
            if len(np.unique(slots)) != len(slots):
                raise IntegrityError(f"a {name} slot is held twice (nodes and transfers)")

    def host_in_flight(self) -> dict[str, int]:
        """Per other component: host slots transfers hold outside the tree (a write's, a
        prefetch's until committed)."""
        out = dict.fromkeys(self.components, 0)
        for p in self.pending.values():
            if isinstance(p, (PendingWrite, PendingPrefetch)):
                for leg in p.legs:
                    if leg.host is not None:
                        out[leg.name] += len(leg.host)
        return out

    def move_pages(self, name: str, device: torch.Tensor, host: torch.Tensor) -> PagePairs:
        """Page ids of member `name` for a write of device slots `device` into host slots
        `host` (whole aligned pages, as the components' hooks hand them out: not checked),
        new arrays the caller's tensors do not share."""
        page = self.member_pages[name]
        device_pages, host_pages = vouched_pages(device, page), vouched_pages(host, page)
        if page == 1:  # vouched_pages made no new array
            return device_pages.copy(), host_pages.copy()
        return device_pages, host_pages

    def leg_bytes(self, leg: TransferLeg, num_slots: int) -> int:
        """Bytes `num_slots` host slots of `leg`'s component move (whole host pages)."""
        return num_slots // self.comp_page_tokens[leg.name] * self.comp_page_bytes[leg.name]

    def free_legs(self, legs: tuple[TransferLeg, ...]) -> None:
        """Hand the host slots `legs` still hold back to their allocators."""
        for leg in legs:
            if leg.host is not None:
                self.free_component_host(leg.name, leg.host)
                leg.host = None

    def lock_move(self, device_node: TreeNode, host_node: TreeNode) -> MoveLocks:
        """Lock the device prefix ending at `device_node` and the host prefix ending at
        `host_node` (a write's source and the host prefix it extends, a load's device prefix
        and the host node it reads up to). Raises as the locks do, holding neither then."""
        device = self.device_tree.lock(device_node)
        try:
            host = self.tier.lock(host_node)
        except BaseException:
            self.device_tree.unlock(device)
            raise
        return MoveLocks(device, host)

    def lock_write(self, device_node: TreeNode, host_node: TreeNode) -> MoveLocks:
        """`lock_move` of a write: `host_node` is `tier.host_prefix(device_node)` (the node
        itself or an ancestor, with a host value or the root), so the device lock's check that
        `device_node` is in the tree covers it, and the host lock takes its trusted walk."""
        device = self.device_tree.lock(device_node)
        return MoveLocks(device, self.tier.lock_trusted(host_node))

    def unlock_move(self, locks: MoveLocks) -> None:
        """Release both locks of `lock_move`."""
        self.tier.unlock(locks.host)
        self.device_tree.unlock(locks.device)

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
        """`alloc_host_array` as a tensor."""
        slots = self.alloc_host_array(num_tokens)
        return None if slots is None else torch.from_numpy(slots)

    def alloc_host_array(self, num_tokens: int) -> npt.NDArray[np.int64] | None:
        """`num_tokens` host slots as a NumPy array (what a write keeps and the tree's host
        values are: no tensor round trip), host-evicting the shortfall first when the
        allocator has fewer free (it refuses exactly then, changing nothing: asking first
        saves the refused call). None when even the eviction leaves too few."""
        allocator = self.host_allocator
        short = num_tokens - allocator.available_size()
        if short > 0:
            self.evict_host(short)
        return allocator.alloc_array(num_tokens)

    def alloc_component_host(self, name: str, num: int) -> torch.Tensor | None:
        """`num` host slots of component `name`; when its pool is short, host-evicts (in the
        host policy's order) only off-device nodes holding such slots, and only when together
        they hold enough (see `HostTier.evict_for`). None, with nothing evicted, when they do
        not: that pool is then held by copies of nodes still on the device (or by transfers)."""
        allocator = self.component_hosts[name]
        slots = allocator.alloc(num)
        if slots is None:
            freed = self.tier.evict_for(self.components[name], num - allocator.available_size())
            self.counters.host_evicted_tokens += freed.tokens
            slots = allocator.alloc(num) if freed.slots else None
        return slots

    # -- TierAccess: what the components' tier hooks call -----------------------------------
    def free_component_host(self, name: str, slots: torch.Tensor) -> None:
        self.component_hosts[name].free(slots)

    def split_node(self, node: TreeNode, num_tokens: int) -> TreeNode:
        return self.device_tree.split_node(node, num_tokens)

    def prefix_slots(self, node: TreeNode) -> torch.Tensor:
        return self.device_tree.prefix_slots(node)

    def set_host(self, name: str, node: TreeNode, value: ComponentValue) -> bool:
        return self.tier.set_host(self.components[name], node, value)

    def evict_device_component(self, name: str, amount: int) -> None:
        self.device_tree.evict(EvictRequest(targets={name: amount}))

    def knows_stored(self, page_key: bytes) -> bool:
        return page_key in self.stored_states
