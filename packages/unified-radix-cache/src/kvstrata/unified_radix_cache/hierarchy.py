"""`HierarchicalCache`: the unified radix cache over device (L1), host (L2) and storage (L3).

Two radix trees over the same keys, one per tier, so that each tier keeps its own slots, locks,
eviction policy and `free + evictable + protected == capacity` sum, and the device-only tree
keeps its fast path untouched (no hierarchical work unless a host tier is configured):

    device_tree  UnifiedRadixCache over the device allocator      what the GPU holds
    host_tree    UnifiedRadixCache over the HostSlotAllocator     what host memory holds
    storage      page keys (chained PageKeyer keys) in the controller's Storage

A prefix's node in one tree and its node in the other cover the same tokens; a node "off the
device" is a host-tree node whose tokens the device tree no longer holds. The tree decides, the
TierController moves, and a tier commits only what an acknowledgement says moved:

    write    device -> host     write_through: on insert; selective: on the 2nd hit;
                                write_back: when the device evicts (the eviction waits)
    load     host -> device     load_back(host_node): device slots, LoadOp, commit on the ack
    prefetch storage -> host    match found >= prefetch_threshold tokens beyond the host hit
    backup   host -> storage    after each committed host write

While an operation is in flight its source and destination are locked in their trees (device
receipt for a write's source pages, host receipt on the prefix the new host pages extend), so
eviction on either tier never frees a page a worker is reading or writing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

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
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.errors import ForeignNode, IntegrityError, InvalidConfig
from kvstrata.unified_radix_cache.events import BlockStored, KVEvent
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import held_len, key_of, node_at, prefix_page_keys
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import (
    EvictRequest,
    InsertResult,
    LockReceipt,
    MatchResult,
)
from kvstrata.unified_radix_cache.tiers import (
    HOST_TIER,
    STORAGE_TIER,
    LoadBack,
    TierCounters,
    TieredMatch,
    TieredRequest,
    TierParams,
    WritePolicy,
)
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

_MEMBER = "full"


class HostSlots:
    """The host slot allocator seen as a tree component's slot sink (CPU token indices)."""

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
    host_receipt: LockReceipt


@dataclass(kw_only=True, eq=False)
class _Backup:
    host_receipt: LockReceipt
    keys: list[bytes]
    parent_key: bytes | None
    key: RadixKey


@dataclass(kw_only=True, eq=False)
class _Prefetch:
    key: RadixKey
    start: int
    host_slots: torch.Tensor
    host_receipt: LockReceipt
    committed: int = 0  # tokens of host_slots already handed to the host tree


@dataclass(kw_only=True, eq=False)
class _Load:
    """A load-back whose wait timed out: its device slots may still be written and its host
    pages read, so both stay held until the late ack frees the slots and drops the lock."""

    device_slots: torch.Tensor
    host_receipt: LockReceipt


_Pending = _Write | _Backup | _Prefetch | _Load


class HierarchicalCache:
    """Device, host and storage tiers of one Full-attention model's prefix cache.

    `device_tree`: a Full-only `UnifiedRadixCache` (the device tier; engines keep using it for
    locks and the request life cycle). `controller`: a `TierController` whose pool group has the
    single member "full" mirroring that tree's pool; with a storage it prefetches and backs up.
    `host_allocator`: the host pool's `HostSlotAllocator` (same page size as the tree).
    `keyer`: the chained page keyer naming storage pages (one for the page size by default).

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
    ) -> None:
        if len(device_tree.components) != 1:
            raise InvalidConfig(
                "hierarchical mode supports Full-only trees (SWA / Mamba host mirroring is not "
                f"wired yet); got components {[c.name for c in device_tree.components]}"
            )
        if controller.group.member_names != (_MEMBER,):
            raise InvalidConfig(
                f"the controller's pool group must have the one member {_MEMBER!r}, got "
                f"{controller.group.member_names}"
            )
        page = device_tree.page_size
        if host_allocator.page_size != page:
            raise InvalidConfig(
                f"host page size {host_allocator.page_size} != tree page size {page}"
            )
        keyer = keyer or PageKeyer(page_size=page)
        if keyer.page_size != page:
            raise InvalidConfig(f"keyer page size {keyer.page_size} != tree page size {page}")
        self.params = params or TierParams()
        self.device_tree = device_tree
        self.controller = controller
        self.host_allocator = host_allocator
        self.keyer = keyer
        self.page_size = page
        full = device_tree.components[0]
        assert isinstance(full, FullComponent), "component 0 of every tree is Full"
        self._device_full = full
        self.host_tree = UnifiedRadixCache(
            [FullComponent(HostSlots(host_allocator))],
            page_size=page,
            eviction_policy=self.params.host_eviction_policy,
            enable_events=True,
            keyer=keyer,
        )
        host_full = self.host_tree.components[0]
        assert isinstance(host_full, FullComponent), "component 0 of every tree is Full"
        self._host_full = host_full
        self._page_bytes = controller.group.page_bytes(_MEMBER)
        self._backups = self.params.backup_to_storage and controller.storage is not None
        self._pending: dict[int, _Pending] = {}
        self._events: list[KVEvent] = []
        self.counters = TierCounters()

    # ------------------------------------------------------------------------------------------
    # Match, prefetch, load-back
    # ------------------------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey, *, max_len: int | None = None) -> TieredMatch:
        """Match `key` (at most `max_len` tokens) on the device and on the host.

        Mutates: access times and hit counts in both trees; commits finished transfers first
        (`poll`). Under `write_through_selective` a device prefix matched for the second time
        and not on the host is queued for a host write. When storage is configured and at least
        `prefetch_threshold` tokens lie beyond both hits, a prefetch of the pages after the host
        hit starts (`prefetch_id`; take it with `finish_prefetch`). Host indices stay valid while
        `host_node` is locked on the host tree. Cost: two tree matches (+ page hashing when a
        prefetch starts).
        """
        self.poll()
        counters = self.counters
        device = self.device_tree.match_prefix(key, max_len=max_len)
        host = self.host_tree.match_prefix(key, max_len=max_len)
        extra = max(host.prefix_len - device.prefix_len, 0)
        counters.queried_tokens += len(key)
        counters.device_hit_tokens += device.prefix_len
        counters.host_hit_tokens += extra
        # The device tree's own host-tier hit counter (RadixCacheCollector, tier="host").
        self.device_tree.host_hit_tokens += extra
        host_indices = host.device_indices[device.prefix_len : host.prefix_len]
        # Prefetch before the selective write: each locks `host.last_node` before allocating
        # host pages, so the host eviction either may run never takes the node the other uses.
        prefetch_id = None
        if self.controller.storage is not None:
            end = len(key) if max_len is None else min(len(key), max(max_len, 0))
            end -= end % self.page_size
            if end - max(device.prefix_len, host.prefix_len) >= self.params.prefetch_threshold:
                prefetch_id = self._start_prefetch(key, host, end)
        if (
            self.params.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
            and device.prefix_len > host.prefix_len
            and device.last_node.hit_count >= 2
        ):
            self._write(key[: device.prefix_len], device.last_node, host)
        return TieredMatch(device, extra, host_indices, host.last_node, prefetch_id)

    def finish_prefetch(self, op_id: int) -> int:
        """Wait for prefetch `op_id` as its policy says (wait_complete: its ack; timeout: up to
        the allowance; best_effort: not at all), stop it, and commit the pages that arrived to
        the host tree. Returns the tokens committed now (more may be committed by a later
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

    def load_back(self, host_node: TreeNode) -> LoadBack:
        """Bring the host pages of the prefix ending at `host_node` (a host-tree node, as
        `TieredMatch.host_node`) that the device lacks back to the device.

        Allocates device slots (evicting unlocked device data, never the prefix itself), loads
        them layer by layer through the controller, waits for the ack and only then inserts
        them into the device tree. On no room or a failed load nothing changes and the device
        hit stays what it was (`loaded_len` 0). Returns the device match of the whole prefix;
        lock `match.last_node` before anything else can evict it. Raises ForeignNode for a
        node not in the host tree."""
        key = key_of(self.host_tree, host_node)
        device = self.device_tree.match_prefix(key)
        start, end = device.prefix_len, len(key)
        if start >= end:
            return LoadBack(0, device)
        dev_receipt = self.device_tree.lock(device.last_node)
        host_receipt: LockReceipt | None = self.host_tree.lock(host_node)
        try:
            slots = self._alloc_device(end - start)
            if slots is None:
                self.counters.load_backs_refused += 1
                return LoadBack(0, device)
            host_slots = self.host_tree.prefix_slots(host_node)[start:end]
            began = time.perf_counter()
            handle = self.controller.submit_load(
                LoadOp(moves={_MEMBER: PageMove(device=slots, host=host_slots)})
            )
            ack = self.controller.wait(handle.op_id, self.params.transfer_timeout_s)
            self.counters.transfer_wait_seconds += time.perf_counter() - began
            if ack is None:
                # The worker may still be writing these slots and reading those host pages:
                # both stay held until the late ack (poll) releases them.
                self.counters.failed_ops += 1
                self._pending[handle.op_id] = _Load(device_slots=slots, host_receipt=host_receipt)
                host_receipt = None
                return LoadBack(0, device)
            if not ack.ok:
                self.counters.failed_ops += 1
                self._device_full.give_back(slots)
                return LoadBack(0, device)
            value = torch.cat([device.device_indices, slots.to(device.device_indices.device)])
            result = self.device_tree.insert(key, value, cached_len=start)
            duplicates = result.duplicates(value)
            if len(duplicates):
                self._device_full.give_back(duplicates)
            self.counters.loaded_tokens += end - start
            self.counters.bytes_h2d += (end - start) // self.page_size * self._page_bytes
            node = result.last_node
            return LoadBack(
                end - start, MatchResult(end, self.device_tree.prefix_slots(node), node)
            )
        finally:
            if host_receipt is not None:
                self.host_tree.unlock(host_receipt)
            self.device_tree.unlock(dev_receipt)

    # ------------------------------------------------------------------------------------------
    # Request life cycle (an engine's view: one call per phase)
    # ------------------------------------------------------------------------------------------
    def begin_request(self, key: RadixKey, *, priority: int = 0) -> TieredRequest:
        """Start a request the way an engine does, over every tier: match at most
        `len(key) - 1` tokens on device and host, take a prefetch from storage when one
        started (by the prefetch policy), load the host part back to the device, then
        `device_tree.begin_request` (match + lock). Returns the request and where its hit
        came from. A failed or refused load leaves the shorter device hit."""
        usable = len(key) - 1
        match = self.match_prefix(key, max_len=usable)
        device_len, host_len = match.device.prefix_len, match.prefix_len
        if match.prefetch_id is not None:
            self.finish_prefetch(match.prefetch_id)
        host = self.host_tree.match_prefix(key, max_len=usable)
        if host.prefix_len > device_len:
            self.load_back(host.last_node)
        req = self.device_tree.begin_request(key, priority=priority, copy_state=False)
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
                self._write(key, node, None)

    # ------------------------------------------------------------------------------------------
    # Insert and eviction
    # ------------------------------------------------------------------------------------------
    def insert(self, key: RadixKey, value: torch.Tensor, *, cached_len: int = 0) -> InsertResult:
        """`device_tree.insert`, then the write policy: under write_through the new device
        pages are queued for a host write. Same contract as `UnifiedRadixCache.insert` (the
        caller frees `result.duplicates(value)`)."""
        result = self.device_tree.insert(key, value, cached_len=cached_len)
        self.inserted(key[: result.prefix_len + result.inserted_len], result.last_node)
        return result

    def inserted(self, key: RadixKey, node: TreeNode) -> None:
        """Tell the cache the device tree now holds `key` ending at device node `node` (for
        callers that insert through the device tree's request life cycle). Under write_through
        the part not on the host is queued for a host write; otherwise nothing happens."""
        if self.params.write_policy is WritePolicy.WRITE_THROUGH and len(key):
            self._write(key, node, None)

    def evict_device(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (or all that is evictable), in the device
        tree's policy order. Under write_back each leaf is first written to the host (the
        eviction waits for the copy). Writes still in flight hold device locks, so when short
        this waits for them and tries again. Returns the tokens freed."""
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
            key = key_of(tree, node)
            op_id = self._write(key, node, None)
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
        order, taking only host copies of data that is off the device (a copy of a prefix the
        device still holds is what makes a later device eviction free under write-through)
        and never pages locked by a transfer in flight. Returns the tokens freed. Cost: one
        read-only device walk per candidate leaf skipped or taken, O(k log n) evictions."""
        heap = self._host_full.heap
        assert heap is not None, "a bound FullComponent has its heap"
        tree = self.host_tree
        skipped: list[LockReceipt] = []
        freed = 0
        try:
            while freed < num_tokens:
                node = heap.peek()
                if node is None:
                    break
                key = key_of(tree, node)
                if held_len(self.device_tree, key) >= len(key):
                    skipped.append(tree.lock(node))  # out of the heap until we are done
                    continue
                got = tree.evict(EvictRequest.full(min(num_tokens - freed, len(node.value))))
                if not got.num_evicted():
                    break
                freed += got.num_evicted()
        finally:
            for receipt in skipped:
                tree.unlock(receipt)
        self.counters.host_evicted_tokens += freed
        return freed

    # ------------------------------------------------------------------------------------------
    # Acknowledgements
    # ------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Commit every finished transfer: writes join the host tree (and start their storage
        backup), prefetches join the host tree as far as they arrived, backups emit storage
        events; failed ones release what they held. Never blocks."""
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
            return  # not ours to commit (a load that load_back waited for itself)
        if isinstance(pending, _Load):
            self._device_full.give_back(pending.device_slots)
            self.host_tree.unlock(pending.host_receipt)
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
    def _write(self, key: RadixKey, node: TreeNode, host: MatchResult | None) -> int | None:
        """Queue a host write of the part of `key` (ending at device node `node`) the host
        lacks. Returns the op id, or None when nothing is queued (already there, host full,
        queue full)."""
        if host is None:
            host = self.host_tree.match_prefix(key)
        start, end = host.prefix_len, len(key)
        if start >= end:
            return None
        host_receipt = self.host_tree.lock(host.last_node)
        slots = self._alloc_host(end - start)
        if slots is None:
            self.host_tree.unlock(host_receipt)
            return None
        device_receipt = self.device_tree.lock(node)
        device_slots = self.device_tree.prefix_slots(node)[start:end]
        try:
            op_id = self.controller.submit_write(
                WriteOp(moves={_MEMBER: PageMove(device=device_slots, host=slots)})
            )
        except QueueFull:
            self.device_tree.unlock(device_receipt)
            self.host_tree.unlock(host_receipt)
            self.host_allocator.free(slots)
            return None
        self._pending[op_id] = _Write(
            key=key,
            start=start,
            host_slots=slots,
            device_receipt=device_receipt,
            host_receipt=host_receipt,
        )
        return op_id

    def _write_acked(self, pending: _Write, ack: Ack) -> None:
        self.device_tree.unlock(pending.device_receipt)
        if not ack.ok:
            self.host_tree.unlock(pending.host_receipt)
            self.host_allocator.free(pending.host_slots)
            return
        num = len(pending.host_slots)
        receipt = self._commit_host(pending.host_receipt, pending.key, pending.host_slots, num)
        self.counters.written_tokens += num
        self.counters.bytes_d2h += num // self.page_size * self._page_bytes
        if self._backups:
            self._backup(receipt, pending.key, pending.start)
        else:
            self.host_tree.unlock(receipt)

    def _backup(self, receipt: LockReceipt, key: RadixKey, start: int) -> None:
        """Queue host -> storage of the pages of `key` from `start` on (the prefix ending at the
        locked host node); the lock passes to the backup until its ack."""
        node = receipt.anchor
        keys = prefix_page_keys(self.host_tree, node)
        first = start // self.page_size
        pages = self.host_tree.prefix_slots(node)[start :: self.page_size] // self.page_size
        try:
            op_id = self.controller.submit_backup(
                BackupOp(keys=keys[first:], host_pages={_MEMBER: pages.tolist()})
            )
        except QueueFull:
            self.host_tree.unlock(receipt)
            return
        parent = keys[first - 1] if first else None
        self._pending[op_id] = _Backup(
            host_receipt=receipt, keys=keys[first:], parent_key=parent, key=key
        )

    def _backup_acked(self, pending: _Backup, ack: Ack) -> None:
        self.host_tree.unlock(pending.host_receipt)
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        self._mark_stored(pending, done * self.page_size)
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
        """Flag the host nodes whose whole run lies in the stored range (`TreeNode.in_storage`:
        what the tier knows of storage; the storage may still evict those pages later)."""
        node = pending.host_receipt.anchor
        end = len(pending.key)
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
    def _start_prefetch(self, key: RadixKey, host: MatchResult, end: int) -> int | None:
        page = self.page_size
        start = host.prefix_len
        share = self.controller.params.prefetch_host_share
        limit = (
            int(share * self.host_allocator.num_pages)
            - self.controller.prefetch_inflight_pages()[_MEMBER]
        )
        num_pages = min((end - start) // page, limit)
        if num_pages <= 0:
            self.counters.prefetches_skipped += 1
            return None
        receipt = self.host_tree.lock(host.last_node)
        slots = self._alloc_host(num_pages * page)
        if slots is None:
            self.host_tree.unlock(receipt)
            self.counters.prefetches_skipped += 1
            return None
        parent = prefix_page_keys(self.host_tree, host.last_node)[-1] if start else None
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
            self.host_tree.unlock(receipt)
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
        """Hand host_slots[committed:upto] (arrived) to the host tree; returns tokens added."""
        got = upto - pending.committed
        key = pending.key[: pending.start + upto]
        pending.host_receipt = self._commit_host(
            pending.host_receipt,
            key,
            pending.host_slots[pending.committed : upto],
            upto - pending.committed,
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
        self.host_tree.unlock(pending.host_receipt)

    # ------------------------------------------------------------------------------------------
    # Shared steps
    # ------------------------------------------------------------------------------------------
    def _commit_host(
        self, receipt: LockReceipt, key: RadixKey, new_slots: torch.Tensor, num: int
    ) -> LockReceipt:
        """Insert `key` into the host tree: its head is the prefix ending at the locked
        `receipt.anchor`, its last `num` tokens are `new_slots` (now the tree's; those already
        present are freed). Moves the lock to the new last node and returns it."""
        base = self.host_tree.prefix_slots(receipt.anchor)
        assert len(base) + num == len(key), (
            f"host commit: {len(base)} held + {num} new != key of {len(key)} tokens"
        )
        value = torch.cat([base, new_slots[:num]])
        result = self.host_tree.insert(key, value, cached_len=len(base))
        duplicates = result.duplicates(value)
        if len(duplicates):
            self.host_allocator.free(duplicates)
        moved = self.host_tree.lock(result.last_node)
        self.host_tree.unlock(receipt)
        return moved

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

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
        was built with events), the host tree's (re-tagged `host`), storage backups."""
        out = list(self.device_tree.take_events())
        out.extend(replace(event, tier=HOST_TIER) for event in self.host_tree.take_events())
        out.extend(self._events)
        self._events = []
        return out

    def reset(self) -> None:
        """Wait for every transfer, then empty both trees (every device and host slot back to
        its allocator; AllBlocksCleared on both tiers). TreeLocked while a request holds a
        device lock. Storage keeps its pages."""
        self.drain()
        self.device_tree.reset()
        self.host_tree.reset()

    @property
    def num_pending(self) -> int:
        """Transfers this cache has in flight (writes, backups, prefetches)."""
        return len(self._pending)

    def check_integrity(self, held: dict[str, int] | None = None) -> None:
        """Both tiers: the device tree (free + evictable + protected + `held` == capacity), the
        host tree (host free + host evictable + host protected == host capacity), the host
        allocator, the controller's bookkeeping, and that every lock the cache holds belongs to
        a transfer in flight. Raises IntegrityError. O(nodes)."""
        device_held = dict(held or {})
        late = sum(len(p.device_slots) for p in self._pending.values() if isinstance(p, _Load))
        device_held["full"] = device_held.get("full", 0) + late
        self.device_tree.check_integrity(device_held)
        # Host slots a transfer holds outside the host tree: a write's or prefetch's new pages
        # until their ack commits them.
        in_flight = sum(
            len(p.host_slots) - (p.committed if isinstance(p, _Prefetch) else 0)
            for p in self._pending.values()
            if isinstance(p, (_Write, _Prefetch))
        )
        self.host_tree.check_integrity({"full": in_flight})
        self.host_allocator.check_integrity()
        self.controller.check_integrity()
        if self.host_tree.num_locked != len(self._pending):
            raise IntegrityError(
                f"host tree has {self.host_tree.num_locked} locks, but {len(self._pending)} "
                "transfers are in flight (each holds exactly one)"
            )
