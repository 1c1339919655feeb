"""`HierarchicalCache`: the unified radix cache over device (L1), host (L2) and storage (L3).

ONE radix tree holds both tiers on its nodes (host_tier.py): a node's `value` are its device
slots (empty when the node is off the device), its `host_value` its host slots, `in_storage`
whether storage acknowledged its pages. One tree, not one per tier, because a prefix is one
thing: a single walk answers "how much is on the device, how much more on the host", a split
splits both tiers at once, and the tiers cannot drift apart (the two-tree version needed a
read-only walk of the other tree for every host-eviction candidate). The device-only fast path
is untouched: the tree takes the hierarchical walks only when a host tier is attached.

    device   node.value         the device slots (Full pool)
    host     node.host_value    the host slots (HostSlotAllocator)
    storage  node.in_storage    pages under their chained PageKeyer keys in the controller's Storage

The tree decides, the TierController moves, and a tier commits only what an acknowledgement
says moved:

    write    device -> host     write_through: on insert; selective: on the 2nd hit;
                                write_back: when the device evicts (the eviction waits)
    load     host -> device     start_load_back(node): device slots, one LoadOp; the caller
                                waits per layer; the nodes get their device slots on the ack
    prefetch storage -> host    match found >= prefetch_threshold tokens beyond the hits
    backup   host -> storage    after each committed host write

Hybrid models (a Full tree with one other component, e.g. Mamba or SWA; a pool group with the
members "full" and the component's name): the transfers ask the component, through its tier
hooks (`TreeComponent.tier_transfer()`, components/transfer.py), what it carries with each
transfer, and nothing here or in the transfer modules names a model family:

- Mamba (components/mamba.py): a write carries the device state of the node it ends at into a
  host state slot (member "mamba" of the same WriteOp), a load-back brings the host state at
  its boundary into a fresh device state slot (same LoadOp), and a host hit ends only where a
  state is restorable. With storage, a backup stores each node's host state beside the page at
  the node's end, and a prefetch fetches the pages up to the deepest boundary whose state this
  cache backed up, plus that state.
- SWA (components/swa.py): a write carries the SWA pages of the last window before its end
  into host SWA slots, a load-back brings the window's SWA pages (the nodes before the window
  come back as SWA tombstones), and a host hit ends only where its window is restorable. With
  storage, a backup stores the host SWA pages of the backed-up nodes beside their pages, and a
  prefetch fetches the pages up to the deepest page whose last window's SWA pages this cache
  backed up, plus those SWA pages.

The cache is composed of one object per transfer kind (tier_core.py has the map), each given
what it uses when built here: `TierWriter` (tier_writes.py: writes and backups), `DeviceRoom`
(tier_room.py: device slots and eviction by write policy), `TierPrefetcher` (tier_prefetch.py),
`TierLoader` (tier_loads.py), over `TierCore` (tier_core.py: shared state, pending records,
ack routing, host slot allocation); this module builds and wires them and keeps match, the
request life cycle and integrity.

While an operation is in flight its source and destination are locked (a device receipt on a
write's source or a load's device prefix, a host receipt on the prefix the host pages extend or
are read from), so eviction on either tier never frees a page a worker is reading or writing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from kvstrata.hybrid_cache import (
    OpKind,
    TierController,
)
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache import tiers
from kvstrata.unified_radix_cache.components.base import ComponentInsert
from kvstrata.unified_radix_cache.components.transfer import TransferLeg
from kvstrata.unified_radix_cache.device_cache import STATES
from kvstrata.unified_radix_cache.errors import IntegrityError, InvalidConfig
from kvstrata.unified_radix_cache.events import KVEvent
from kvstrata.unified_radix_cache.host_tier import HostTier
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import (
    EvictRequest,
    InsertResult,
    MatchResult,
    PrefixHit,
)
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    NO_SLOTS,
    PendingBackup,
    PendingLoad,
    PendingPrefetch,
    PendingWrite,
    TierCore,
    prefix_len,
    run_above,
)
from kvstrata.unified_radix_cache.tier_loads import TierLoader
from kvstrata.unified_radix_cache.tier_prefetch import TierPrefetcher
from kvstrata.unified_radix_cache.tier_room import DeviceRoom
from kvstrata.unified_radix_cache.tier_writes import TierWriter
from kvstrata.unified_radix_cache.tiers import WritePolicy
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache


class HostSlots:
    """The host slot allocator seen as a slot sink (CPU token indices)."""

    device = torch.device("cpu")

    def __init__(self, allocator: HostSlotAllocator) -> None:
        self.allocator = allocator

    @property
    def size(self) -> int:
        return self.allocator.size

    def free(self, indices: torch.Tensor) -> None:
        """Free token indices: whole aligned pages, as `alloc` handed them out (raises as
        `HostSlotAllocator.free`, before anything changes)."""
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()


class _TreeHostSlots(HostSlots):
    """The sink `HierarchicalCache` gives its host tier: it frees only host values the tree
    took from this allocator (whole aligned pages, as `alloc` handed them out). With the
    allocator's compiled `free` (one C call that checks everything) that is the free; without
    it their page ids go back without re-checking the alignment (the free list still refuses
    a page out of range or already free)."""

    def free(self, indices: torch.Tensor) -> None:
        allocator = self.allocator
        if allocator.compiled:
            allocator.free(indices)  # a third of the page-id path's cost
            return
        flat = indices.numpy()
        page = self.allocator.page_size
        self.allocator.free_pages(torch.from_numpy(flat[::page] // page if page > 1 else flat))


class HierarchicalCache:
    """Device, host and storage tiers of one model's prefix cache: Full attention, or Full plus
    one other component with tier hooks (attention + Mamba, full + sliding-window, or a kind of
    your own: components/transfer.py).

    `device_tree`: an empty Full-only or Full + one component (e.g. Mamba, SWA)
    `UnifiedRadixCache` over the device allocators; the cache
    attaches a `HostTier` to it (`cache.tier`), so the same tree holds the host copies (engines
    keep using it for locks and the request life cycle). `controller`: a `TierController` whose
    pool group has the member "full" and one per other component, by its name ("mamba", "swa");
    with a storage it prefetches and backs up.
    `host_allocator`: the host pool's `HostSlotAllocator` (same page size as the tree).
    `keyer`: the chained page keyer naming storage pages (the tree's, or one for the page size).
    `component_hosts`: per component besides Full (by name, exactly those of the tree), the
    host allocator of its host copies: for "mamba" the `MambaHostPool`'s (page size 1: one
    host state slot per entry), for "swa" the SWA host pool's (same page size as the tree).

    Not thread-safe: call it from the scheduler thread; the controller's workers never touch it.
    """

    def __init__(
        self,
        device_tree: UnifiedRadixCache,
        *,
        controller: TierController,
        host_allocator: HostSlotAllocator,
        params: tiers.TierParams | None = None,
        keyer: PageKeyer | None = None,
        component_hosts: Mapping[str, HostSlotAllocator] | None = None,
    ) -> None:
        extras = device_tree.components[1:]
        if len(extras) > 1 or any(c.tier_transfer() is None for c in extras):
            raise InvalidConfig(
                "hierarchical mode supports a Full tree with at most one other component, one "
                f"with tier hooks (TreeComponent.tier_transfer); got components "
                f"{[c.name for c in device_tree.components]}"
            )
        hosts = dict(component_hosts or {})
        if set(hosts) != {c.name for c in extras}:
            raise InvalidConfig(
                "component_hosts must give a host allocator for each component besides Full "
                f"({[c.name for c in extras]}) and no other, got {sorted(hosts)}"
            )
        members = (FULL, *(c.name for c in extras))
        if sorted(controller.group.member_names) != sorted(members):
            raise InvalidConfig(
                f"the controller's pool group must have the members {members}, got "
                f"{controller.group.member_names}"
            )
        page = device_tree.page_size
        if host_allocator.page_size != page:
            raise InvalidConfig(
                f"host page size {host_allocator.page_size} != tree page size {page}"
            )
        for component in extras:
            allocator = hosts[component.name]
            if component.unit == "tokens" and allocator.page_size != page:
                raise InvalidConfig(
                    f"host {component.name} page size {allocator.page_size} != tree page size "
                    f"{page}"
                )
        # The transfers pass slots to the controller unchecked (its trusted path): each host
        # allocator must hand out only whole pages of its member's host pool, and the tree's
        # slots (checked against its allocators on insert) must lie in the device pools.
        for name, allocator in ((FULL, host_allocator), *hosts.items()):
            member = controller.group.member(name)
            if allocator.page_size != member.host.page_size:
                raise InvalidConfig(
                    f"the {name} host allocator's page size {allocator.page_size} != its host "
                    f"pool's page size {member.host.page_size}"
                )
            if allocator.num_pages > member.host.num_pages:
                raise InvalidConfig(
                    f"the {name} host allocator has {allocator.num_pages} pages, its host pool "
                    f"{member.host.num_pages}"
                )
        for component in device_tree.components:
            device = controller.group.member(component.name).device
            rows = component.capacity() + device.page_size  # page 0 reserved
            if rows > device.num_rows:
                raise InvalidConfig(
                    f"the tree's {component.name} slots reach row {rows - 1}, past its device "
                    f"pool's {device.num_rows} rows"
                )
        keyer = keyer or device_tree.keyer or PageKeyer(page_size=page)
        if keyer.page_size != page:
            raise InvalidConfig(f"keyer page size {keyer.page_size} != tree page size {page}")
        if device_tree.host_tier is not None or device_tree.num_nodes:
            raise InvalidConfig("the device tree must be empty and have no host tier yet")
        self.params = params or tiers.TierParams()
        self.device_tree = device_tree
        self.controller = controller
        self.host_allocator = host_allocator
        self.page_size = page
        #: The host allocators of the components besides Full, by name.
        self.component_hosts = hosts
        self.tier = HostTier(
            device_tree,
            _TreeHostSlots(host_allocator),
            eviction_policy=self.params.host_eviction_policy,
            keyer=keyer,
            component_hosts={name: _TreeHostSlots(a) for name, a in hosts.items()},
        )
        self.keyer = self.tier.keyer
        # The parts, each given what it uses (tier_core.py has the map).
        self.core = TierCore(
            device_tree=device_tree,
            tier=self.tier,
            controller=controller,
            host_allocator=host_allocator,
            component_hosts=hosts,
            params=self.params,
        )
        self.counters = self.core.counters
        self.writer = TierWriter(self.core)
        self.room = DeviceRoom(self.core, self.writer)
        self.prefetcher = TierPrefetcher(self.core, self.writer)
        self.loader = TierLoader(self.core, self.writer, self.room)
        self.core.route(PendingWrite, self.writer.commit_write)
        self.core.route(PendingBackup, self.writer.commit_backup)
        self.core.route(PendingPrefetch, self.prefetcher.commit)
        self.core.route(PendingLoad, self.loader.commit)

    def match_prefix(
        self, key: RadixKey, *, max_len: int | None = None, wait_now: bool = False
    ) -> tiers.TieredMatch:
        """Match `key` (at most `max_len` tokens) over both tiers in one walk of the tree.

        Mutates: access times and hit counts on the path, the tree's and the cache's query and
        hit counters (once per call); commits finished transfers first (`poll`). Under
        `write_through_selective` a device prefix matched for the second time and not on the
        host is queued for a host write. When storage is configured and at least
        `prefetch_threshold` tokens lie beyond both hits, a prefetch of the pages beyond both
        hits starts (`prefetch_id`; take it with `finish_prefetch`); host values are
        prefix-closed, so when the host copy ends before the device hit (write_back,
        write_through_selective) no prefetch starts: the device-only part is queued for a host
        write instead and a later match prefetches. Host indices stay valid
        while `host_node` is host-locked (`load_back` locks it itself). Cost: one tree walk
        (+ page hashing when a prefetch starts). `wait_now`: the caller takes the prefetch at
        once (`finish_prefetch` right after, as `begin_request` does), so under wait_complete a
        CPU controller runs it on this thread (`TierController.runs_inline`).
        """
        device, prefetch_id = self._match(key, max_len, wait_now)
        extra = device.host_hit_len
        last_host = device.last_host_node
        host_node = last_host if last_host is not None else device.last_node
        if last_host is not None:
            # A copy: the run can be a view of a node's host slots, and the caller owns this.
            host_indices = torch.from_numpy(run_above(last_host, extra, host=True).copy())
        else:
            host_indices = NO_SLOTS  # shared and empty: a torch op per match costs more
        return tiers.TieredMatch(device, extra, host_indices, host_node, prefetch_id)

    def _match(
        self, key: RadixKey, max_len: int | None, wait_now: bool
    ) -> tuple[MatchResult, int | None]:
        """`match_prefix` up to its result: the one counted walk over both tiers (its
        `MatchResult` carries the device and the host hit) and the prefetch id; no host
        indices are gathered (`begin_request` loads by node, it never reads them)."""
        self.poll()
        counters = self.counters
        device = self.device_tree.match_prefix(key, max_len=max_len)
        extra = device.host_hit_len
        counters.queried_tokens += len(key)
        counters.device_hit_tokens += device.prefix_len
        counters.host_hit_tokens += extra
        prefetch_id = None
        if self.controller.storage is not None:
            end = len(key) if max_len is None else min(len(key), max(max_len, 0))
            end -= end % self.page_size
            if end - device.prefix_len - extra >= self.params.prefetch_threshold:
                prefetch_id = self._prefetch_beyond(key, device, end, wait_now=wait_now)
        node = device.last_node
        if (
            self.params.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            and device.prefix_len
            and node.host_value is None
            and node.hit_count >= 2
            and not self.writer.in_flight(node)
        ):
            self.writer.write(key[: device.prefix_len], node)
        return device, prefetch_id

    def _prefetch_beyond(
        self, key: RadixKey, device: MatchResult, end: int, *, wait_now: bool = False
    ) -> int | None:
        """Start a prefetch of key[max(device hit, host hit):end]. The pages it fetches extend
        the host prefix, so when the host copy ends before the device hit the gap must reach
        the host first: queue its write (unless one is in flight) and skip the prefetch
        (counted in `prefetches_skipped`) rather than re-read pages the device holds; a later
        match prefetches."""
        last_host = device.last_host_node
        anchor = self.tier.host_prefix(last_host if last_host is not None else device.last_node)
        if prefix_len(anchor) >= device.prefix_len:
            return self.prefetcher.start(key, anchor, end, wait_now=wait_now)
        self.counters.prefetches_skipped += 1
        node = device.last_node
        if not self.writer.in_flight(node):
            self.writer.write(key[: device.prefix_len], node)
        return None

    # ------------------------------------------------------------------------------------------
    # The engine-facing protocol (protocol.PrefixCache)
    # ------------------------------------------------------------------------------------------
    @property
    def evicted_tokens(self) -> int:
        """Full-attention tokens evicted from the device so far (off-device host copies and
        nodes that left the tree alike)."""
        return self.core.device_full.evicted_total

    def begin_request(self, key: RadixKey, *, priority: int = 0) -> CacheRequest:
        """Start a request (`PrefixCache.begin_request`): match at most `len(key) - 1` tokens
        on both tiers in one counted walk, take a prefetch from storage when one started (by
        the prefetch policy), load the host part back to the device, then lock the device
        prefix. `req.hit` says where the hit came from; its `load` is the load's per-layer
        handle (committed before this returns: every layer has arrived). The key is walked
        again only when a prefetch added host nodes or a load could not be made (a refused or
        failed load leaves the shorter device hit)."""
        usable = len(key) - 1
        tree = self.device_tree
        self.writer.on_request()
        if type(self).match_prefix is HierarchicalCache.match_prefix:
            final, prefetch_id = self._match(key, usable, True)
        else:  # a subclass keeps its `match_prefix` (`_match` is its part up to the result)
            match = self.match_prefix(key, max_len=usable, wait_now=True)
            final, prefetch_id = match.device, match.prefetch_id
        device_len = final.prefix_len
        host_len = device_len + final.host_hit_len
        if prefetch_id is not None:
            self.finish_prefetch(prefetch_id)
            final = self.tier.match_key(key, usable)
        host_node = final.last_host_node
        load: tiers.TierLoad | None = None
        if host_node is not None:
            load = self.start_load_back(host_node, wait_now=True)
            back = load.wait(self.params.transfer_timeout_s)
            if back is None:
                self.counters.transfer_timeouts += 1
            if back is not None and back.loaded_len:
                final = back.match
            else:
                final = self.tier.match_key(key, usable)
        state_slot = None
        last = final.last_node
        for component in tree.components[1:]:
            # A state component gives the request its own copy of the boundary state.
            copied = component.finalize_match(last, True)
            if copied is not None:
                state_slot = copied
        hit = final.prefix_len
        from_device = min(hit, device_len)
        from_host = max(min(hit, host_len) - from_device, 0)
        return CacheRequest(
            key=key,
            kv_indices=final.device_indices,
            cached_len=hit,
            hit_len=hit,
            receipt=tree.lock(last),
            state_slot=state_slot,
            priority=priority,
            page_size=self.page_size,
            hit=PrefixHit(
                device_len=from_device,
                host_len=from_host,
                storage_len=hit - from_device - from_host,
                load=load,
            ),
        )

    def alloc_tokens(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate-or-evict (`PrefixCache.alloc_tokens`): Full pages go through the write
        policy (`evict_device`: write_back copies a leaf before it goes), then the other token
        components (SWA) drop their own shortfall."""
        return self.room.alloc(num_tokens)

    def alloc_state(self) -> torch.Tensor | None:
        """One device state slot of the tree's state component (`unit` "states", e.g. Mamba),
        evicting an unlocked cached state when the pool is out (its `alloc_device` hook)."""
        states = self._states()
        if states is None:
            raise InvalidConfig("alloc_state on a tree without a state component")
        return self.core.transfers[states].alloc_device(self.core, TransferLeg(name=states, size=1))

    def _states(self) -> str | None:
        """The name of the component holding one state per node (`unit` "states"), or None."""
        return next((c.name for c in self.core.components.values() if c.unit == STATES), None)

    def cache_unfinished_request(self, req: CacheRequest) -> None:
        """The device tree's `cache_unfinished_request` (one state slot made free first for
        the chunk's state copy), then the write policy for the chunk: under write_through the
        part the host lacks is queued for a host write, so the state at the chunk's end can
        reach the host too."""
        states = self._states()
        if (
            states is not None
            and req.state_slot is not None
            and self.core.components[states].free_size() < 1
        ):
            self.device_tree.evict(EvictRequest(targets={states: 1}))
        node = self.device_tree.cache_unfinished_request(req)
        self._written(req.key[: req.cached_len], node)

    def cache_finished_request(self, req: CacheRequest) -> None:
        """`device_tree.cache_finished_request(req)`, then the write policy for what the tree
        now holds of the request (write_through: queue the host write)."""
        num_kv = req.kv_indices.numel()
        key = req.key[: num_kv - num_kv % self.page_size]
        node = self.device_tree.cache_finished_request(req)
        self._written(key, node)

    def abort_request(self, req: CacheRequest) -> None:
        """Drop the request without inserting: free its own slots and state, unlock."""
        self.device_tree.abort_request(req)

    def release(self, slots: torch.Tensor) -> None:
        """Give back KV slots from `alloc_tokens` that no request holds."""
        self.core.device_full.give_back(slots)

    def transfer_counters(self) -> tiers.TierCounters:
        return self.counters

    def _written(self, key: RadixKey, node: TreeNode) -> None:
        if self.params.write_policy is WritePolicy.WRITE_THROUGH and len(key) and node.parent:
            self.writer.write(key, node)

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        *,
        cached_len: int = 0,
        inputs: Mapping[str, ComponentInsert] | None = None,
    ) -> InsertResult:
        """`device_tree.insert` (off-device nodes on the key take `value`'s slots again), then
        the write policy: under write_through the new device pages (and, in a Mamba tree, the
        state of the node ending at the key, e.g. `inputs={"mamba": MambaInsert(slot=s)}`) are
        queued for a host write. Same contract as `UnifiedRadixCache.insert` (the caller frees
        `result.duplicates(value)`, and its state slot unless "mamba" is in
        `result.adopted_states`)."""
        result = self.device_tree.insert(key, value, cached_len=cached_len, inputs=inputs)
        self._written(key[: result.prefix_len + result.inserted_len], result.last_node)
        return result

    def evict_device(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (or all that is evictable), from the device
        leaves in the tree's policy order, through the write policy (`DeviceRoom.evict`).
        Returns the tokens freed."""
        return self.room.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host tokens (`TierCore.evict_host`). Returns the tokens
        freed."""
        return self.core.evict_host(num_tokens)

    def finish_prefetch(self, op_id: int) -> int:
        """Take prefetch `op_id` by its policy and commit what arrived (`TierPrefetcher.finish`).
        Returns the tokens committed now."""
        return self.prefetcher.finish(op_id)

    def start_load_back(self, node: TreeNode, *, wait_now: bool = False) -> tiers.TierLoad:
        """Start bringing the prefix ending at `node` back to the device, layer by layer
        (`TierLoader.start`)."""
        return self.loader.start(node, wait_now=wait_now)

    def load_back(self, node: TreeNode) -> tiers.LoadBack:
        """Blocking load-back of the prefix ending at `node` (`TierLoader.load_back`)."""
        return self.loader.load_back(node)

    def poll(self) -> None:
        """Commit every finished transfer: writes give their nodes host values (and start
        their storage backup), prefetches add host values as far as they arrived, loads give
        their nodes device slots again, backups flag stored nodes; failed ones release what
        they held. Never blocks."""
        self.core.poll()

    def drain(self, kind: OpKind | None = None) -> None:
        """Wait for every transfer in flight (of `kind`, or all) and commit it. Raises
        TimeoutError when one is not acknowledged within `transfer_timeout_s` (it stays in
        flight, its locks held, and a later `poll` or `drain` commits it)."""
        kinds = {
            OpKind.WRITE: PendingWrite,
            OpKind.BACKUP: PendingBackup,
            OpKind.PREFETCH: PendingPrefetch,
            OpKind.LOAD: PendingLoad,
        }
        self.writer.flush()
        began = time.perf_counter()
        while True:
            ids = [
                op_id
                for op_id, p in self.core.pending.items()
                if kind is None or isinstance(p, kinds[kind])
            ]
            if not ids:
                break
            ack = self.controller.wait(ids[0], self.params.transfer_timeout_s)
            if ack is None:
                raise TimeoutError(f"transfer op {ids[0]} not acknowledged in time")
            self.core.on_ack(ack)
        self.counters.transfer_wait_seconds += time.perf_counter() - began

    def take_events(self) -> list[KVEvent]:
        """Drain the events of every tier, each carrying its tier: the device tree's, the host
        tier's (`host`), storage backups (`storage`). All are queued only when the device tree
        was built with events (`enable_events`); otherwise this returns []."""
        out = list(self.device_tree.take_events())
        out.extend(self.tier.take_events())
        out.extend(self.core.events)
        self.core.events.clear()
        return out

    def reset(self) -> None:
        """Wait for every transfer, then empty the tree (every device and host slot back to
        its allocator; AllBlocksCleared on both tiers). TreeLocked while a request holds a
        device lock. Storage keeps its pages."""
        self.drain()
        self.tier.reset()
        self.device_tree.reset()

    @property
    def num_pending(self) -> int:
        """Transfers this cache has in flight (writes, backups, prefetches, loads)."""
        return len(self.core.pending)

    def check_integrity(self, held: dict[str, int] | None = None) -> None:
        """Both tiers of the one tree: device free + evictable + protected + `held` (+ the
        slots of loads in flight) == device capacity; host free + evictable + protected + in
        flight == host capacity; both tiers prefix-closed, off-device nodes carry a host value;
        device and host lock counts equal their receipts, and every host receipt is the one a
        transfer in flight holds (by id); no host page, nor host slot of another component, is
        held twice (nodes and transfers); the host allocators and the controller's bookkeeping.
        Raises IntegrityError. O(nodes + host slots log host slots)."""
        device_held = dict(held or {})
        loading = sum(
            len(p.device_slots) for p in self.core.pending.values() if isinstance(p, PendingLoad)
        )
        device_held[FULL] = device_held.get(FULL, 0) + loading
        for p in self.core.pending.values():
            if isinstance(p, PendingLoad):
                for leg in p.legs:
                    held_by = self.core.transfers[leg.name].load_device_held(
                        leg, len(p.device_slots)
                    )
                    device_held[leg.name] = device_held.get(leg.name, 0) + held_by
        self.device_tree.check_integrity(device_held)
        # Host slots a transfer holds outside the tree: a write's or prefetch's new pages until
        # their ack commits them.
        in_flight = sum(
            len(p.host_slots) - (p.committed if isinstance(p, PendingPrefetch) else 0)
            for p in self.core.pending.values()
            if isinstance(p, (PendingWrite, PendingPrefetch))
        )
        self.tier.check_integrity(in_flight, self.core.host_in_flight())
        self.host_allocator.check_integrity()
        for allocator in self.component_hosts.values():
            allocator.check_integrity()
        self.controller.check_integrity()
        if self.tier.num_locked != len(self.core.pending):
            raise IntegrityError(
                f"the host tier has {self.tier.num_locked} locks, but {len(self.core.pending)} "
                "transfers are in flight (each holds exactly one)"
            )
        self.core.check_pending()
