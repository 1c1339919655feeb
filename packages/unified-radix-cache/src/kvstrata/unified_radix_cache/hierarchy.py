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

Mamba models (a Full + Mamba tree, a pool group with members "full" and "mamba"): a write
carries the device state of the node it ends at into a host state slot (member "mamba" of the
same WriteOp), a load-back brings the host state at its boundary into a fresh device state slot
(same LoadOp), and a host hit ends only where a state is restorable. Storage stays Full-only:
a Mamba tree with a storage-backed controller is refused (InvalidConfig).

While an operation is in flight its source and destination are locked (a device receipt on a
write's source or a load's device prefix, a host receipt on the prefix the host pages extend or
are read from), so eviction on either tier never frees a page a worker is reading or writing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    LoadOp,
    OpKind,
    PageMove,
    PrefetchOp,
    PrefetchPolicy,
    QueueFull,
    TierController,
    WriteOp,
)
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache.components.base import ComponentInsert
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.mamba import MambaComponent, MambaInsert
from kvstrata.unified_radix_cache.errors import ForeignNode, IntegrityError, InvalidConfig
from kvstrata.unified_radix_cache.events import BlockStored, KVEvent
from kvstrata.unified_radix_cache.host_tier import HostReceipt, HostTier
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import key_of, node_at
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import (
    EvictRequest,
    InsertResult,
    LockReceipt,
    MatchResult,
)
from kvstrata.unified_radix_cache.tiers import (
    STORAGE_TIER,
    LoadBack,
    TierCounters,
    TieredMatch,
    TieredRequest,
    TierLoad,
    TierParams,
    WritePolicy,
)
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

_MEMBER = "full"
_MAMBA = "mamba"
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class HostSlots:
    """The host slot allocator seen as a slot sink (CPU token indices)."""

    device = torch.device("cpu")

    def __init__(self, allocator: HostSlotAllocator) -> None:
        self.allocator = allocator

    @property
    def size(self) -> int:
        return self.allocator.size

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()


@dataclass(kw_only=True, eq=False)
class _Write:
    key: RadixKey
    start: int  # tokens already on the host when submitted
    host_slots: torch.Tensor  # host token slots of key[start:]
    device_receipt: LockReceipt
    host_receipt: HostReceipt
    host_state: torch.Tensor | None = None  # Mamba: the host state slot of the key's end


@dataclass(kw_only=True, eq=False)
class _Backup:
    host_receipt: HostReceipt
    keys: list[bytes]
    parent_key: bytes | None
    key: RadixKey


@dataclass(kw_only=True, eq=False)
class _Prefetch:
    key: RadixKey
    start: int
    host_slots: torch.Tensor
    host_receipt: HostReceipt
    committed: int = 0  # tokens of host_slots already handed to the tree


@dataclass(kw_only=True, eq=False)
class _Load:
    """A load-back in flight: its device slots are outside the tree until the ack commits them;
    the device prefix it extends and the host pages it reads stay locked until then."""

    key: RadixKey
    start: int
    device_slots: torch.Tensor
    device_receipt: LockReceipt
    host_receipt: HostReceipt
    load: TierLoad
    device_state: torch.Tensor | None = None  # Mamba: the fresh device slot of the state


_Pending = _Write | _Backup | _Prefetch | _Load


def _prefix_len(node: TreeNode) -> int:
    total = 0
    probe = node
    while probe.parent is not None:
        total += probe.num_tokens
        probe = probe.parent
    return total


class HierarchicalCache:
    """Device, host and storage tiers of one Full-attention (or attention + Mamba) model's
    prefix cache.

    `device_tree`: an empty Full-only or Full + Mamba `UnifiedRadixCache` over the device
    allocators (a Mamba tree has no storage tier yet); the cache
    attaches a `HostTier` to it (`cache.tier`), so the same tree holds the host copies (engines
    keep using it for locks and the request life cycle). `controller`: a `TierController` whose
    pool group has the member "full" (and "mamba" for a Mamba tree); with a storage it prefetches
    and backs up.
    `host_allocator`: the host pool's `HostSlotAllocator` (same page size as the tree).
    `keyer`: the chained page keyer naming storage pages (the tree's, or one for the page size).
    `host_state_allocator`: for a Full + Mamba tree (and only then), the `MambaHostPool`'s
    allocator (page size 1: one host state slot per entry); its group has members "full" and
    "mamba", and it has no storage (storage is Full-only for now).

    Not thread-safe: call it from the scheduler thread; the controller's workers never touch it.
    """

    def __init__(
        self,
        device_tree: UnifiedRadixCache,
        *,
        controller: TierController,
        host_allocator: HostSlotAllocator,
        params: TierParams | None = None,
        keyer: PageKeyer | None = None,
        host_state_allocator: HostSlotAllocator | None = None,
    ) -> None:
        extras = device_tree.components[1:]
        mamba = extras[0] if len(extras) == 1 else None
        if len(extras) > 1 or (extras and not isinstance(mamba, MambaComponent)):
            raise InvalidConfig(
                "hierarchical mode supports Full-only and Full + Mamba trees (SWA host values "
                f"are not wired yet); got components {[c.name for c in device_tree.components]}"
            )
        assert mamba is None or isinstance(mamba, MambaComponent)
        members = (_MEMBER,) if mamba is None else (_MEMBER, _MAMBA)
        if sorted(controller.group.member_names) != sorted(members):
            raise InvalidConfig(
                f"the controller's pool group must have the members {members}, got "
                f"{controller.group.member_names}"
            )
        if (mamba is None) != (host_state_allocator is None):
            raise InvalidConfig(
                "host_state_allocator is required for a Mamba tree and only for one"
            )
        if mamba is not None and controller.storage is not None:
            raise InvalidConfig(
                "storage (L3) is Full-only: a Mamba tree's prefetch and backup of boundary "
                "states are not wired yet; use a controller without storage"
            )
        page = device_tree.page_size
        if host_allocator.page_size != page:
            raise InvalidConfig(
                f"host page size {host_allocator.page_size} != tree page size {page}"
            )
        keyer = keyer or device_tree.keyer or PageKeyer(page_size=page)
        if keyer.page_size != page:
            raise InvalidConfig(f"keyer page size {keyer.page_size} != tree page size {page}")
        if device_tree.host_tier is not None or device_tree.num_nodes:
            raise InvalidConfig("the device tree must be empty and have no host tier yet")
        self.params = params or TierParams()
        self.device_tree = device_tree
        self.controller = controller
        self.host_allocator = host_allocator
        self.page_size = page
        full = device_tree.components[0]
        assert isinstance(full, FullComponent), "component 0 of every tree is Full"
        self._device_full = full
        self._mamba = mamba
        self.host_state_allocator = host_state_allocator
        self.tier = HostTier(
            device_tree,
            HostSlots(host_allocator),
            eviction_policy=self.params.host_eviction_policy,
            keyer=keyer,
            host_states=None if host_state_allocator is None else HostSlots(host_state_allocator),
        )
        self.keyer = self.tier.keyer
        self._page_bytes = controller.group.page_bytes(_MEMBER)
        self._backups = self.params.backup_to_storage and controller.storage is not None
        self._pending: dict[int, _Pending] = {}
        self._events: list[KVEvent] = []
        self.counters = TierCounters()

    # ------------------------------------------------------------------------------------------
    # Match, prefetch, load-back
    # ------------------------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, *, max_len: int | None = None) -> TieredMatch:
        """Match `key` (at most `max_len` tokens) over both tiers in one walk of the tree.

        Mutates: access times and hit counts on the path, the tree's and the cache's query and
        hit counters (once per call); commits finished transfers first (`poll`). Under
        `write_through_selective` a device prefix matched for the second time and not on the
        host is queued for a host write. When storage is configured and at least
        `prefetch_threshold` tokens lie beyond both hits, a prefetch of the pages after the host
        prefix starts (`prefetch_id`; take it with `finish_prefetch`). Host indices stay valid
        while `host_node` is host-locked (`load_back` locks it itself). Cost: one tree walk
        (+ page hashing when a prefetch starts).
        """
        self.poll()
        counters = self.counters
        device = self.device_tree.match_prefix(key, max_len=max_len)
        extra = device.host_hit_len
        counters.queried_tokens += len(key)
        counters.device_hit_tokens += device.prefix_len
        counters.host_hit_tokens += extra
        last_host = device.last_host_node
        host_node = last_host if last_host is not None else device.last_node
        if last_host is not None:
            host_indices = self.tier.host_slots(last_host)[device.prefix_len :]
        else:
            host_indices = torch.empty(0, dtype=torch.int64)
        prefetch_id = None
        if self.controller.storage is not None:
            end = len(key) if max_len is None else min(len(key), max(max_len, 0))
            end -= end % self.page_size
            if end - device.prefix_len - extra >= self.params.prefetch_threshold:
                prefetch_id = self._start_prefetch(key, self.tier.host_prefix(host_node), end)
        node = device.last_node
        if (
            self.params.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            and device.prefix_len
            and node.host_value is None
            and node.hit_count >= 2
        ):
            self._write(key[: device.prefix_len], node)
        return TieredMatch(device, extra, host_indices, host_node, prefetch_id)

    def finish_prefetch(self, op_id: int) -> int:
        """Wait for prefetch `op_id` as its policy says (wait_complete: its ack; timeout: up to
        the allowance; best_effort: not at all), stop it, and commit the pages that arrived to
        the host tier. Returns the tokens committed now (more may be committed by a later
        `poll` when the ack reports pages that were still landing). Re-match afterwards."""
        pending = self._pending.get(op_id)
        if not isinstance(pending, _Prefetch):
            raise ForeignNode(f"op {op_id} is not a prefetch of this cache in flight")
        policy = self.params.prefetch_policy
        start = time.perf_counter()
        ack: Ack | None = None
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            ack = self.controller.wait(op_id, self.params.transfer_timeout_s)
        elif policy is PrefetchPolicy.TIMEOUT:
            allowance = self.params.prefetch_timeout.seconds(len(pending.host_slots))
            ack = self.controller.wait(op_id, allowance)
        self.counters.transfer_wait_seconds += time.perf_counter() - start
        if ack is not None:
            before = pending.committed
            self._on_ack(ack)
            return self._prefetched_tokens(ack) - before
        progress = self.controller.stop_prefetch(op_id)
        ready = progress.num_pages_ready * self.page_size
        if ready > pending.committed:
            return self._commit_prefetch(pending, ready)
        return 0

    def start_load_back(self, node: TreeNode) -> TierLoad:
        """Start bringing the prefix ending at `node` (`TieredMatch.host_node`) back to the
        device: allocate device slots for its off-device part (evicting unlocked device data,
        never the prefix itself) and submit one layer-wise LoadOp. Returns at once; the caller
        waits per layer (`wait_layer`) and the nodes get their device slots only on the ack
        (`TierLoad.wait`, `poll`, `drain`). Nothing to load or no device room: a done handle
        with `loaded_len` 0 and the tree unchanged. Raises ForeignNode for a node not in the
        tree (e.g. host-evicted since the match)."""
        tree = self.device_tree
        key = key_of(tree, node)
        device = self.tier.match_key(key)
        anchor = device.last_node
        mamba = self._mamba
        host_state: int | None = None
        if mamba is not None:
            # The on-device run may reach past the device hit (nodes without a device state):
            # their pages stay; only the off-device pages and the boundary state move.
            anchor = node
            while anchor.parent is not None and not len(anchor.value):
                anchor = anchor.parent
            if mamba.slot(node) is None:
                host_state = node.host_state
        start, end = _prefix_len(anchor), len(key)
        if start >= end and host_state is None:
            return self._done_load(LoadBack(0, device))
        device_receipt = tree.lock(anchor)
        host_receipt = self.tier.lock(node)
        slots = self._alloc_device(end - start) if end > start else _NO_SLOTS
        state = self._alloc_device_state() if host_state is not None else None
        handle = None
        if slots is not None and (host_state is None or state is not None):
            moves: dict[str, PageMove] = {}
            if end > start:
                host_slots = self.tier.host_slots(node)[start:end]
                moves[_MEMBER] = PageMove(device=slots, host=host_slots)
            if state is not None and host_state is not None:
                moves[_MAMBA] = PageMove(
                    device=state, host=torch.tensor([host_state], dtype=torch.int64)
                )
            try:
                handle = self.controller.submit_load(LoadOp(moves=moves))
            except QueueFull:
                handle = None
        if slots is None or handle is None:
            if slots is not None and len(slots):
                self._device_full.give_back(slots)
            if state is not None and mamba is not None:
                mamba.give_back(state)
            self.counters.load_backs_refused += 1
            self.tier.unlock(host_receipt)
            tree.unlock(device_receipt)
            return self._done_load(LoadBack(0, device))
        load = TierLoad(num_tokens=end - start, handle=handle, finish=self._finish_load)
        self._pending[handle.op_id] = _Load(
            key=key,
            start=start,
            device_slots=slots,
            device_receipt=device_receipt,
            host_receipt=host_receipt,
            load=load,
            device_state=state,
        )
        return load

    def load_back(self, node: TreeNode) -> LoadBack:
        """Blocking `start_load_back(node)` (an engine without a layer-wise forward): waits for
        the whole load and its commit. Returns the tokens loaded (0 when refused, failed or not
        acknowledged within `transfer_timeout_s`: a late ack still commits at `poll`) and the
        device match of the prefix (valid while `match.last_node` is locked)."""
        load = self.start_load_back(node)
        result = load.wait(self.params.transfer_timeout_s)
        if result is not None:
            return result
        self.counters.failed_ops += 1
        device = self.tier.match_key(key_of(self.device_tree, node))
        return LoadBack(0, device)

    def _done_load(self, result: LoadBack) -> TierLoad:
        return TierLoad(num_tokens=0, handle=None, finish=self._finish_load, result=result)

    def _finish_load(self, load: TierLoad, timeout_s: float | None) -> LoadBack | None:
        op_id = load.op_id
        if op_id is None or op_id not in self._pending:
            return load.result  # committed by a poll already
        began = time.perf_counter()
        ack = self.controller.wait(op_id, timeout_s)
        self.counters.transfer_wait_seconds += time.perf_counter() - began
        if ack is not None:
            self._on_ack(ack)
        return load.result

    def _load_acked(self, pending: _Load, ack: Ack) -> None:
        tree = self.device_tree
        anchor = pending.device_receipt.anchor
        if ack.ok:
            value = torch.cat(
                [tree.prefix_slots(anchor), pending.device_slots.to(tree.full_device)]
            )
            state = pending.device_state
            inputs = None if state is None else {_MAMBA: MambaInsert(slot=int(state.item()))}
            result = tree.insert(pending.key, value, cached_len=pending.start, inputs=inputs)
            duplicates = result.duplicates(value)
            if len(duplicates):
                self._device_full.give_back(duplicates)
            if state is not None and _MAMBA not in result.adopted_states:
                self._give_back_state(state)
            num = len(pending.key) - pending.start
            self.counters.loaded_tokens += num
            self.counters.bytes_h2d += num // self.page_size * self._page_bytes
            node = result.last_node
            pending.load.result = LoadBack(
                num, MatchResult(len(pending.key), tree.prefix_slots(node), node)
            )
        else:
            self.counters.failed_ops += 1
            if len(pending.device_slots):
                self._device_full.give_back(pending.device_slots)
            if pending.device_state is not None:
                self._give_back_state(pending.device_state)
            pending.load.result = LoadBack(
                0, MatchResult(pending.start, tree.prefix_slots(anchor), anchor)
            )
        self.tier.unlock(pending.host_receipt)
        tree.unlock(pending.device_receipt)

    # ------------------------------------------------------------------------------------------
    # Request life cycle (an engine's view: one call per phase)
    # ------------------------------------------------------------------------------------------
    def begin_request(self, key: RadixKey, *, priority: int = 0) -> TieredRequest:
        """Start a request the way an engine without a layer-wise forward does: match at most
        `len(key) - 1` tokens on both tiers (counted once), take a prefetch from storage when
        one started (by the prefetch policy), load the host part back to the device and wait
        for all of it, then lock the device prefix. Returns the request and where its hit came
        from. A failed or refused load leaves the shorter device hit."""
        usable = len(key) - 1
        tree = self.device_tree
        match = self.match_prefix(key, max_len=usable)
        device_len, host_len = match.device.prefix_len, match.prefix_len
        host_node = match.device.last_host_node
        if match.prefetch_id is not None:
            self.finish_prefetch(match.prefetch_id)
            host_node = self.tier.match_key(key, usable).last_host_node
        if host_node is not None:
            self.load_back(host_node)
        final = self.tier.match_key(key, usable)
        state_slot = None
        if self._mamba is not None:
            # The request advances its own copy of the boundary state (copy-on-write).
            state_slot = self._mamba.finalize_match(final.last_node, True)
        req = CacheRequest(
            key=key,
            kv_indices=final.device_indices,
            cached_len=final.prefix_len,
            hit_len=final.prefix_len,
            receipt=tree.lock(final.last_node),
            state_slot=state_slot,
            priority=priority,
            page_size=self.page_size,
        )
        hit = req.cached_len
        from_device = min(hit, device_len)
        from_host = max(min(hit, host_len) - from_device, 0)
        return TieredRequest(
            request=req,
            device_hit_len=from_device,
            host_hit_len=from_host,
            storage_hit_len=hit - from_device - from_host,
        )

    def cache_finished_request(self, req: CacheRequest) -> None:
        """`device_tree.cache_finished_request(req)`, then the write policy for what the tree
        now holds of the request (write_through: queue the host write)."""
        num_kv = len(req.kv_indices)
        key = req.key[: num_kv - num_kv % self.page_size]
        self.device_tree.cache_finished_request(req)
        if self.params.write_policy is WritePolicy.WRITE_THROUGH and len(key):
            node = node_at(self.device_tree, key)
            if node is not None:
                self._write(key, node)

    # ------------------------------------------------------------------------------------------
    # Insert and eviction
    # ------------------------------------------------------------------------------------------
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
        self.inserted(key[: result.prefix_len + result.inserted_len], result.last_node)
        return result

    def inserted(self, key: RadixKey, node: TreeNode) -> None:
        """Tell the cache the device tree now holds `key` ending at device node `node` (for
        callers that insert through the device tree's request life cycle). Under write_through
        the part not on the host is queued for a host write; otherwise nothing happens."""
        if self.params.write_policy is WritePolicy.WRITE_THROUGH and len(key):
            self._write(key, node)

    def evict_device(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (or all that is evictable), from the device
        leaves in the tree's policy order: a leaf with a host copy goes off the device and stays
        in the tree, one without leaves it. Under write_back each leaf is first written to the
        host (the eviction waits for the copy). Writes still in flight hold device locks, so
        when short this waits for them and tries again. Returns the tokens freed."""
        self.poll()
        freed = self._evict_device_once(num_tokens)
        if freed < num_tokens and any(isinstance(p, _Write) for p in self._pending.values()):
            self.drain(OpKind.WRITE)
            freed += self._evict_device_once(num_tokens - freed)
        return freed

    def _evict_device_once(self, num_tokens: int) -> int:
        tree = self.device_tree
        if self.params.write_policy is not WritePolicy.WRITE_BACK:
            return tree.evict(EvictRequest.full(num_tokens)).num_evicted()
        heap = self._device_full.heap
        assert heap is not None, "a bound FullComponent has its heap"
        freed = 0
        while freed < num_tokens:
            node = heap.peek()
            if node is None:
                break
            op_id = self._write(key_of(tree, node), node)
            if op_id is not None:
                began = time.perf_counter()
                ack = self.controller.wait(op_id, self.params.transfer_timeout_s)
                self.counters.transfer_wait_seconds += time.perf_counter() - began
                if ack is not None:
                    self._on_ack(ack)
            # The write unlocked the leaf again, with its old policy key: it is the heap top.
            got = tree.evict(EvictRequest.full(min(num_tokens - freed, len(node.value))))
            if got.num_evicted() == 0:
                break
            freed += got.num_evicted()
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host tokens (or all that may go), in the host policy's
        order: host copies of nodes off the device, childless and not locked by a transfer;
        each such node leaves the tree (storage keeps its pages). A copy of a prefix the device
        still holds never goes (it is what makes a later device eviction free). Returns the
        tokens freed. Cost: O(k log n)."""
        freed = self.tier.evict(num_tokens)
        self.counters.host_evicted_tokens += freed
        return freed

    # ------------------------------------------------------------------------------------------
    # Acknowledgements
    # ------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Commit every finished transfer: writes give their nodes host values (and start
        their storage backup), prefetches add host values as far as they arrived, loads give
        their nodes device slots again, backups flag stored nodes; failed ones release what
        they held. Never blocks."""
        if not self._pending:
            return
        for ack in self.controller.poll_acks():
            self._on_ack(ack)

    def drain(self, kind: OpKind | None = None) -> None:
        """Wait for every transfer in flight (of `kind`, or all) and commit it."""
        kinds = {
            OpKind.WRITE: _Write,
            OpKind.BACKUP: _Backup,
            OpKind.PREFETCH: _Prefetch,
            OpKind.LOAD: _Load,
        }
        began = time.perf_counter()
        while True:
            ids = [
                op_id
                for op_id, p in self._pending.items()
                if kind is None or isinstance(p, kinds[kind])
            ]
            if not ids:
                break
            ack = self.controller.wait(ids[0], self.params.transfer_timeout_s)
            if ack is None:
                raise TimeoutError(f"transfer op {ids[0]} not acknowledged in time")
            self._on_ack(ack)
        self.counters.transfer_wait_seconds += time.perf_counter() - began

    def _on_ack(self, ack: Ack) -> None:
        pending = self._pending.pop(ack.op_id, None)
        if pending is None:
            return
        if isinstance(pending, _Load):
            self._load_acked(pending, ack)
            return
        if ack.status is AckStatus.FAILED:
            self.counters.failed_ops += 1
        if isinstance(pending, _Write):
            self._write_acked(pending, ack)
        elif isinstance(pending, _Backup):
            self._backup_acked(pending, ack)
        else:
            self._prefetch_acked(pending, ack)

    # ------------------------------------------------------------------------------------------
    # Writes and backups
    # ------------------------------------------------------------------------------------------
    def _write(self, key: RadixKey, node: TreeNode) -> int | None:
        """Queue a host write of the part of `key` (ending at device node `node`) the host
        lacks. Returns the op id, or None when nothing is queued (already there, host full,
        queue full)."""
        anchor = self.tier.host_prefix(node)
        start, end = _prefix_len(anchor), len(key)
        mamba = self._mamba
        device_state = mamba.slot(node) if mamba is not None else None
        want_state = device_state is not None and node.host_state is None
        if start >= end and not want_state:
            return None
        host_receipt = self.tier.lock(anchor)
        slots = self._alloc_host(end - start) if end > start else _NO_SLOTS
        if slots is None:
            self.tier.unlock(host_receipt)
            return None
        # No host state slot to be had: the pages still go (the host hit then ends earlier).
        host_state = self._alloc_host_state() if want_state else None
        if not len(slots) and host_state is None:
            self.tier.unlock(host_receipt)
            return None
        device_receipt = self.device_tree.lock(node)
        moves: dict[str, PageMove] = {}
        if len(slots):
            device_slots = self.device_tree.prefix_slots(node)[start:end]
            moves[_MEMBER] = PageMove(device=device_slots, host=slots)
        if host_state is not None and device_state is not None:
            moves[_MAMBA] = PageMove(
                device=torch.tensor([device_state], dtype=torch.int64), host=host_state
            )
        try:
            op_id = self.controller.submit_write(WriteOp(moves=moves))
        except QueueFull:
            self.device_tree.unlock(device_receipt)
            self.tier.unlock(host_receipt)
            if len(slots):
                self.host_allocator.free(slots)
            if host_state is not None:
                self._free_host_state(host_state)
            return None
        self._pending[op_id] = _Write(
            key=key,
            start=start,
            host_slots=slots,
            device_receipt=device_receipt,
            host_receipt=host_receipt,
            host_state=host_state,
        )
        return op_id

    def _write_acked(self, pending: _Write, ack: Ack) -> None:
        self.device_tree.unlock(pending.device_receipt)
        state = pending.host_state
        if not ack.ok:
            self.tier.unlock(pending.host_receipt)
            if len(pending.host_slots):
                self.host_allocator.free(pending.host_slots)
            if state is not None:
                self._free_host_state(state)
            return
        num = len(pending.host_slots)
        receipt = self.tier.commit(pending.host_receipt, pending.key, pending.host_slots)
        if state is not None and not self.tier.set_host_state(receipt.anchor, int(state.item())):
            self._free_host_state(state)
        self.counters.written_tokens += num
        self.counters.bytes_d2h += num // self.page_size * self._page_bytes
        if self._backups:
            self._backup(receipt, pending.key, pending.start)
        else:
            self.tier.unlock(receipt)

    def _backup(self, receipt: HostReceipt, key: RadixKey, start: int) -> None:
        """Queue host -> storage of the pages of `key` from `start` on (the prefix ending at the
        host-locked node); the lock passes to the backup until its ack."""
        node = receipt.anchor
        keys = self.tier.page_keys(node)
        first = start // self.page_size
        pages = self.tier.host_slots(node)[start :: self.page_size] // self.page_size
        try:
            op_id = self.controller.submit_backup(
                BackupOp(keys=keys[first:], host_pages={_MEMBER: pages.tolist()})
            )
        except QueueFull:
            self.tier.unlock(receipt)
            return
        parent = keys[first - 1] if first else None
        self._pending[op_id] = _Backup(
            host_receipt=receipt, keys=keys[first:], parent_key=parent, key=key
        )

    def _backup_acked(self, pending: _Backup, ack: Ack) -> None:
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        self._mark_stored(pending, done * self.page_size)
        self.tier.unlock(pending.host_receipt)
        if done:
            self.counters.backed_up_tokens += done * self.page_size
            self.counters.bytes_storage_set += done * self._page_bytes
            self._events.append(
                BlockStored(
                    page_keys=tuple(pending.keys[:done]),
                    parent_key=pending.parent_key,
                    tokens_per_page=self.page_size,
                    tier=STORAGE_TIER,
                    namespace=pending.key.namespace,
                )
            )

    def _mark_stored(self, pending: _Backup, num_tokens: int) -> None:
        """Flag the nodes whose whole run lies in the stored range (`TreeNode.in_storage`: what
        the tier knows of storage; the storage may still evict those pages later)."""
        node = pending.host_receipt.anchor
        end = _prefix_len(node)
        lo = end - len(pending.keys) * self.page_size  # the backup covered key[lo:end]
        hi = lo + num_tokens  # and storage acknowledged key[lo:hi]
        while node.parent is not None and end > lo:
            if end - node.num_tokens >= lo and end <= hi:
                node.in_storage = True
            end -= node.num_tokens
            node = node.parent

    # ------------------------------------------------------------------------------------------
    # Prefetch
    # ------------------------------------------------------------------------------------------
    def _start_prefetch(self, key: RadixKey, anchor: TreeNode, end: int) -> int | None:
        """Prefetch `key[start:end]` from storage into new host pages, `start` the end of the
        host prefix ending at `anchor` (host values stay prefix-closed)."""
        page = self.page_size
        start = _prefix_len(anchor)
        share = self.controller.params.prefetch_host_share
        limit = (
            int(share * self.host_allocator.num_pages)
            - self.controller.prefetch_inflight_pages()[_MEMBER]
        )
        num_pages = min((end - start) // page, limit)
        if num_pages <= 0:
            self.counters.prefetches_skipped += 1
            return None
        receipt = self.tier.lock(anchor)
        slots = self._alloc_host(num_pages * page)
        if slots is None:
            self.tier.unlock(receipt)
            self.counters.prefetches_skipped += 1
            return None
        parent = self.tier.page_keys(anchor)[-1] if start else None
        keys = self.keyer.page_keys(
            key.tokens()[start : start + num_pages * page],
            extra_key=key.extra_key,
            cache_salt=key.cache_salt,
            parent=parent,
        )
        op = PrefetchOp(
            keys=keys,
            host_pages={_MEMBER: (slots[::page] // page).tolist()},
            num_tokens=num_pages * page,
            policy=self.params.prefetch_policy,
            timeout=self.params.prefetch_timeout,
        )
        try:
            op_id = self.controller.submit_prefetch(op)
        except QueueFull:
            op_id = None
        if op_id is None:
            self.tier.unlock(receipt)
            self.host_allocator.free(slots)
            self.counters.prefetches_skipped += 1
            return None
        self.counters.prefetches_started += 1
        self._pending[op_id] = _Prefetch(
            key=key[: start + num_pages * page], start=start, host_slots=slots, host_receipt=receipt
        )
        return op_id

    def _prefetched_tokens(self, ack: Ack) -> int:
        return (ack.num_pages_done if ack.status is not AckStatus.FAILED else 0) * self.page_size

    def _commit_prefetch(self, pending: _Prefetch, upto: int) -> int:
        """Hand host_slots[committed:upto] (arrived) to the tree; returns tokens added."""
        got = upto - pending.committed
        key = pending.key[: pending.start + upto]
        pending.host_receipt = self.tier.commit(
            pending.host_receipt, key, pending.host_slots[pending.committed : upto]
        )
        pending.committed = upto
        self.counters.storage_hit_tokens += got
        self.counters.bytes_storage_get += got // self.page_size * self._page_bytes
        return got

    def _prefetch_acked(self, pending: _Prefetch, ack: Ack) -> None:
        done = self._prefetched_tokens(ack)
        if done < len(pending.host_slots):
            self.counters.short_prefetches += 1
        if done > pending.committed:
            self._commit_prefetch(pending, done)
        rest = pending.host_slots[max(done, pending.committed) :]
        if len(rest):
            self.host_allocator.free(rest)
        self.tier.unlock(pending.host_receipt)

    # ------------------------------------------------------------------------------------------
    # Shared steps
    # ------------------------------------------------------------------------------------------
    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

    def _alloc_host_state(self) -> torch.Tensor | None:
        """One host state slot, host-evicting off-device nodes until one frees (None when no
        host node may go)."""
        allocator = self.host_state_allocator
        assert allocator is not None, "host states in a tree without Mamba"
        slot = allocator.alloc(1)
        while slot is None and self.evict_host(1):
            slot = allocator.alloc(1)
        return slot

    def _free_host_state(self, slot: torch.Tensor) -> None:
        assert self.host_state_allocator is not None, "host states in a tree without Mamba"
        self.host_state_allocator.free(slot)

    def _alloc_device_state(self) -> torch.Tensor | None:
        """One device state slot, evicting an unlocked device state when the pool is out."""
        mamba = self._mamba
        assert mamba is not None, "device states in a tree without Mamba"
        slot = mamba.allocator.alloc(1)
        if slot is None:
            self.device_tree.evict(EvictRequest(targets={_MAMBA: 1}))
            slot = mamba.allocator.alloc(1)
        return slot

    def _give_back_state(self, slot: torch.Tensor) -> None:
        assert self._mamba is not None, "device states in a tree without Mamba"
        self._mamba.give_back(slot)

    def _alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        allocator = self._device_full.allocator
        short = num_tokens - self._device_full.free_size()
        if short > 0:
            self.evict_device(short)
        alloc = getattr(allocator, "alloc", None)
        assert alloc is not None, "the device tree's allocator must allocate (SlotAllocator)"
        slots = alloc(num_tokens)
        return slots if isinstance(slots, torch.Tensor) else None

    # ------------------------------------------------------------------------------------------
    # Events, integrity
    # ------------------------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the events of every tier, each carrying its tier: the device tree's (when it
        was built with events), the host tier's (`host`), storage backups (`storage`)."""
        out = list(self.device_tree.take_events())
        out.extend(self.tier.take_events())
        out.extend(self._events)
        self._events = []
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
        return len(self._pending)

    def check_integrity(self, held: dict[str, int] | None = None) -> None:
        """Both tiers of the one tree: device free + evictable + protected + `held` (+ the
        slots of loads in flight) == device capacity; host free + evictable + protected + in
        flight == host capacity; both tiers prefix-closed, off-device nodes carry a host value;
        device and host lock counts equal their receipts, and every host lock belongs to a
        transfer in flight; the host allocator and the controller's bookkeeping. Raises
        IntegrityError. O(nodes)."""
        device_held = dict(held or {})
        loading = sum(len(p.device_slots) for p in self._pending.values() if isinstance(p, _Load))
        device_held["full"] = device_held.get("full", 0) + loading
        if self._mamba is not None:
            states = sum(
                1
                for p in self._pending.values()
                if isinstance(p, _Load) and p.device_state is not None
            )
            device_held[_MAMBA] = device_held.get(_MAMBA, 0) + states
        self.device_tree.check_integrity(device_held)
        # Host slots a transfer holds outside the tree: a write's or prefetch's new pages until
        # their ack commits them.
        in_flight = sum(
            len(p.host_slots) - (p.committed if isinstance(p, _Prefetch) else 0)
            for p in self._pending.values()
            if isinstance(p, (_Write, _Prefetch))
        )
        states_in_flight = sum(
            1 for p in self._pending.values() if isinstance(p, _Write) and p.host_state is not None
        )
        self.tier.check_integrity(in_flight, states_in_flight)
        self.host_allocator.check_integrity()
        if self.host_state_allocator is not None:
            self.host_state_allocator.check_integrity()
        self.controller.check_integrity()
        if self.tier.num_locked != len(self._pending):
            raise IntegrityError(
                f"the host tier has {self.tier.num_locked} locks, but {len(self._pending)} "
                "transfers are in flight (each holds exactly one)"
            )
