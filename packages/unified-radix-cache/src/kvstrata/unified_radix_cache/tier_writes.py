"""Device -> host writes and host -> storage backups of a `HierarchicalCache` (`TierWriter`).

A write moves the pages the host lacks (member "full") plus what each other component's
`plan_write` asks for (components/transfer.py: e.g. the device state of the node it ends at,
the SWA pages of the last window before its end); its ack gives the nodes their host values.
With storage, each committed write is backed up: its pages under their chained page keys and,
beside them, the host pages each component's `backup_pages` names; the backup's ack flags the
stored nodes and remembers the stored page keys a prefetch may end at (`remembered`).
"""

from __future__ import annotations

import time

import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    PagePairs,
    QueueFull,
)
from kvstrata.unified_radix_cache.components.transfer import TransferLeg
from kvstrata.unified_radix_cache.events import BlockStored
from kvstrata.unified_radix_cache.host_tier import HostReceipt
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    NO_HOST_SLOTS,
    PendingBackup,
    PendingWrite,
    TierCore,
    prefix_len,
    run_above,
)
from kvstrata.unified_radix_cache.tiers import (
    STORAGE_TIER,
)


class TierWriter:
    """The write and backup transfers of a `HierarchicalCache`, over its shared `core`
    (pending records, counters, host slot allocation). Writes are queued and sent in batches
    (`params.write_batch`); `flush` sends the queue, and every other transfer kind calls it
    before it wakes the controller so the writes ride along."""

    def __init__(self, core: TierCore) -> None:
        self._core = core
        # Writes queued for the next batch: temporary id (negative, also the key of their
        # record in `core.pending`) and the op to submit (page ids per member).
        self._unsent: list[tuple[int, dict[str, PagePairs]]] = []
        self._unsent_ids = 0
        # Requests begun so far, and how many had begun when the oldest queued write was
        # queued (a queue that waited `write_batch` requests is sent even when short of one).
        self._num_requests = 0
        self._unsent_since = 0

    @property
    def num_unsent(self) -> int:
        """Writes queued, not yet submitted."""
        return len(self._unsent)

    def on_request(self) -> None:
        """A request began: send the queue when its oldest write waited `write_batch`
        requests."""
        self._num_requests += 1
        batch = self._core.params.write_batch
        if self._unsent and self._num_requests - self._unsent_since > batch:
            self.flush()

    def write(self, key: RadixKey, node: TreeNode, *, now: bool = False) -> int | None:
        """Queue a host write of the part of `key` (ending at device node `node`) the host
        lacks: host slots and both locks are taken now, the op is submitted with the next
        batch (`params.write_batch` queued writes, or before anything waits on a transfer or
        submits another kind). With `now`, submit at once and return the controller's op id
        (None when nothing was queued: already there, host full, queue full); otherwise the
        id is a temporary negative one."""
        core = self._core
        anchor = core.tier.host_prefix(node)
        start, end = prefix_len(anchor), len(key)
        # A Full-only tree (no component to plan a part) skips the components' steps.
        plans = self._plan_parts(node, end) if core.transfers else None
        if start >= end and not plans:
            return None
        locks = core.lock_write(node, anchor)
        num = end - start if end > start else 0
        host_slots = core.alloc_host_array(num) if num else NO_HOST_SLOTS
        if host_slots is None:
            core.unlock_move(locks)
            return None
        legs = self._host_legs(plans) if plans else ()
        if not num and not legs:
            core.unlock_move(locks)
            return None
        # Page ids, made once here from the tree's own slots (no index tensor on the way).
        pages: dict[str, PagePairs] = {}
        if num:
            page = core.full_page
            pages[FULL] = (run_above(node, num)[::page] // page, host_slots[::page] // page)
        for leg in legs:
            assert leg.host is not None
            device = core.transfers[leg.name].write_source(core, node, leg)
            pages[leg.name] = core.move_pages(leg.name, device, leg.host)
        pending = PendingWrite(key=key, start=start, locks=locks, legs=legs, host_slots=host_slots)
        # Queued, not yet submitted: a temporary negative id until `flush` hands the batch to
        # the controller (one wake-up of its worker for the whole batch).
        self._unsent_ids -= 1
        temp_id = self._unsent_ids
        unsent = self._unsent
        if not unsent:
            self._unsent_since = self._num_requests
        core.pending[temp_id] = pending
        core.num_unsent += 1
        unsent.append((temp_id, pages))
        if now or len(unsent) >= core.params.write_batch:
            return self.flush().get(temp_id)
        return temp_id

    def _plan_parts(self, node: TreeNode, end: int) -> list[TransferLeg]:
        """What each other component asks a write of the prefix ending at `node` to carry."""
        core = self._core
        return [
            leg
            for transfer in core.transfers.values()
            if (leg := transfer.plan_write(core, node, end)) is not None
        ]

    def _host_legs(self, plans: list[TransferLeg]) -> tuple[TransferLeg, ...]:
        """The planned parts that got their component's host slots. A component whose host
        slots cannot be had is left out: the pages still go (the host hit then ends earlier,
        e.g. where a state or window is not restorable)."""
        legs: list[TransferLeg] = []
        for leg in plans:
            leg.host = self._core.alloc_component_host(leg.name, leg.size)
            if leg.host is not None:
                legs.append(leg)
        return tuple(legs)

    def flush(self) -> dict[int, int]:
        """Submit every queued write, oldest first, in one burst (the controller's worker wakes
        once and merges them; a CPU controller runs the merged batch on this thread,
        `TierController.runs_inline`). A write the queue refuses is rolled back: its locks released,
        its host slots freed. Returns temporary id -> op id of the writes submitted."""
        unsent, self._unsent = self._unsent, []
        submitted: dict[int, int] = {}
        if unsent:
            self._core.counters.write_batches += 1
        # Trusted page ids: the slots come from the tree's and the host tier's own allocators,
        # over the group's pools (HierarchicalCache checks their sizes once, when built).
        op_ids = self._core.controller.submit_write_pages([op for _, op in unsent], inline=True)
        self._core.num_unsent -= len(unsent)
        for (temp_id, _), op_id in zip(unsent, op_ids, strict=True):
            pending = self._core.pending.pop(temp_id)
            assert isinstance(pending, PendingWrite), "a queued write id names a write"
            if op_id is None:  # the queue had no room
                self._roll_back_write(pending)
                continue
            self._core.pending[op_id] = pending
            submitted[temp_id] = op_id
        self._core.counters.writes_submitted += len(submitted)
        return submitted

    def _roll_back_write(self, pending: PendingWrite) -> None:
        """Release what a write that moved nothing held: both locks, its host slots."""
        self._core.unlock_move(pending.locks)
        if len(pending.host_slots):
            self._core.host_allocator.free(torch.from_numpy(pending.host_slots))
        self._core.free_legs(pending.legs)

    def in_flight(self, node: TreeNode) -> bool:
        """Whether a write in flight covers `node` (its source reaches through it)."""
        for pending in self._core.pending.values():
            if isinstance(pending, PendingWrite):
                probe: TreeNode | None = pending.device_receipt.anchor
                while probe is not None:
                    if probe is node:
                        return True
                    probe = probe.parent
        return False

    def wait_all(self) -> bool:
        """Wait for the writes in flight (each up to `transfer_timeout_s`) and commit them,
        stopping (the rest left in flight) at the first one not acknowledged in time. Returns
        whether any write committed (so a retry of the eviction may free more)."""
        acked = False
        self.flush()
        began = time.perf_counter()
        while True:
            pending = self._core.pending.items()
            op_id = next((i for i, p in pending if isinstance(p, PendingWrite)), None)
            if op_id is None:
                break
            ack = self._core.controller.wait(op_id, self._core.params.transfer_timeout_s)
            if ack is None:
                self._core.counters.transfer_timeouts += 1
                break
            self._core.on_ack(ack)
            acked = True
        self._core.counters.transfer_wait_seconds += time.perf_counter() - began
        return acked

    def commit_write(self, pending: PendingWrite, ack: Ack) -> None:
        core = self._core
        if not ack.ok:
            self._roll_back_write(pending)
            return
        locks = pending.locks
        core.device_tree.unlock(locks.device)
        host_slots = pending.host_slots
        num = len(host_slots)
        # The new host copy stays locked only for what follows that reads it: the components'
        # commits and a backup.
        receipt = core.tier.commit_path(
            locks.host,
            locks.device.anchor,
            pending.key,
            host_slots,
            keep_lock=bool(pending.legs) or core.backups,
        )
        moved = num // core.page_size * core.page_bytes
        counters = core.counters
        counters.written_tokens += num
        if receipt is None:
            counters.bytes_d2h += moved
            return
        # Each component's data moved with the pages even when a node meanwhile got its own.
        for leg in pending.legs:
            host = leg.host
            assert host is not None
            core.transfers[leg.name].commit_write(core, leg, receipt.anchor, len(pending.key))
            leg.host = None  # the nodes hold it now (or it went back)
            moved += core.leg_bytes(leg, len(host))
        core.counters.bytes_d2h += moved
        if core.backups:
            # A component's host pages may lie before `start` (on pages stored before, e.g. a
            # window's SWA pages): the backup then starts there so they go to storage too
            # (stored pages are skipped).
            lo = pending.start
            for leg in pending.legs:
                at = core.transfers[leg.name].backup_start(leg)
                if at is not None:
                    lo = min(lo, at)
            self._backup(receipt, pending.key, lo, pending.start)
        else:
            core.tier.unlock(receipt)

    def _backup(
        self, receipt: HostReceipt, key: RadixKey, start: int, fresh: int | None = None
    ) -> None:
        """Queue host -> storage of the pages of `key` from `start` on (the prefix ending at the
        host-locked node); the lock passes to the backup until its ack. Pages before `fresh`
        (default `start`) were stored before: they are re-sent only for the other components'
        pages beside them (e.g. SWA pages) and the ack counts and announces only the pages
        from `fresh` on."""
        node = receipt.anchor
        page = self._core.page_size
        first = start // page
        # Only the keys from page `first` on (and the one before: the chain's parent) are
        # joined, not the whole prefix's: a backup costs its own pages, not the prefix's.
        lo = first - 1 if first else 0
        tail = self._core.tier.page_keys(node, lo)
        num_keys = lo + len(tail)
        keys = tail[first - lo :]
        parent = tail[0] if first else None
        # NumPy on the host slots of the pages from `start` on (the nodes they span only).
        pages = run_above(node, num_keys * page - start, host=True)[::page] // page
        # `tolist` makes a new list of ints: no copy into a `list[int | None](...)` (whose call
        # alone costs several times the list's).
        full: list[int | None] = pages.tolist()
        host_pages: dict[str, list[int | None]] = {FULL: full}
        comp_pages: list[tuple[str, tuple[int, ...]]] = []
        for name, transfer in self._core.transfers.items():
            part = transfer.backup_pages(self._core, node, first, num_keys)
            host_pages[name] = part
            comp_pages.append((name, tuple(i for i, p in enumerate(part) if p is not None)))
        op = BackupOp(keys=keys, host_pages=host_pages)
        pending = PendingBackup(
            host_receipt=receipt,
            keys=keys,
            parent_key=parent,
            key=key,
            comp_pages=tuple(comp_pages),
            fresh_from=(start if fresh is None else fresh) // self._core.page_size - first,
        )
        held = self._core.held_backups
        if held is not None:  # inside `poll`: sent together at its end
            held.append((op, pending))
            return
        try:
            op_id = self._core.controller.submit_backup(op, inline=True, trusted=True)
        except QueueFull:
            self._core.tier.unlock(receipt)
            return
        self._core.pending[op_id] = pending

    def commit_backup(self, pending: PendingBackup, ack: Ack) -> None:
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        self._mark_stored(pending, done * self._core.page_size)
        self._core.tier.unlock(pending.host_receipt)
        fresh = min(pending.fresh_from, done)
        if done:
            core = self._core
            moved = (done - fresh) * core.page_bytes
            for name, pages in pending.comp_pages:
                stored = [i for i in pages if i < done]
                # e.g. only the last window before `done` makes a stored prefix's window
                # restorable: SWA pages further back name no prefix a prefetch could end at.
                for i in core.transfers[name].remembered(stored, done):
                    self._know_stored_state(pending.keys[i])
                moved += len(stored) * core.comp_page_bytes[name]
            core.counters.backed_up_tokens += (done - fresh) * core.page_size
            core.counters.bytes_storage_set += moved
        if done > fresh and self._core.tier.events_on:
            self._core.events.append(
                BlockStored(
                    page_keys=tuple(pending.keys[fresh:done]),
                    parent_key=pending.keys[fresh - 1] if fresh else pending.parent_key,
                    tokens_per_page=self._core.page_size,
                    tier=STORAGE_TIER,
                    namespace=pending.key.namespace,
                )
            )

    def _mark_stored(self, pending: PendingBackup, num_tokens: int) -> None:
        """Flag the nodes whose whole run lies in the stored range (`TreeNode.in_storage`: what
        the tier knows of storage; the storage may still evict those pages later)."""
        node = pending.host_receipt.anchor
        end = prefix_len(node)
        lo = end - len(pending.keys) * self._core.page_size  # the backup covered key[lo:end]
        hi = lo + num_tokens  # and storage acknowledged key[lo:hi]
        while node.parent is not None and end > lo:
            if end - node.num_tokens >= lo and end <= hi:
                node.in_storage = True
            end -= node.num_tokens
            node = node.parent

    def _know_stored_state(self, page_key: bytes) -> None:
        known = self._core.stored_states
        known[page_key] = None
        known.move_to_end(page_key)
        while len(known) > self._core.params.known_stored_states:
            known.popitem(last=False)
