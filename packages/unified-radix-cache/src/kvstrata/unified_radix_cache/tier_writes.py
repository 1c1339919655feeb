"""Device -> host writes and host -> storage backups of a `HierarchicalCache` (`TierWriter`).

A write moves the pages the host lacks (member "full") plus, in a Mamba tree, the device state
of the node it ends at (member "mamba") and, in an SWA tree, the SWA pages of the last window
before its end (member "swa"); its ack gives the nodes their host values. With storage, each
committed write is backed up: its pages under their chained page keys and, in a Mamba tree,
each node's host state beside the page at the node's end; the backup's ack flags the stored
nodes and remembers the stored state keys a prefetch may fetch.
"""

from __future__ import annotations

import time

import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    BackupOp,
    PageMove,
    QueueFull,
    WriteOp,
)
from kvstrata.unified_radix_cache.events import BlockStored
from kvstrata.unified_radix_cache.host_tier import HostReceipt
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    MAMBA,
    NO_SLOTS,
    SWA,
    PendingBackup,
    PendingWrite,
    TierCore,
    prefix_len,
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
        # record in `core.pending`) and the op to submit.
        self._unsent: list[tuple[int, WriteOp]] = []
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
        anchor = self._core.tier.host_prefix(node)
        start, end = prefix_len(anchor), len(key)
        mamba = self._core.mamba
        device_state = mamba.slot(node) if mamba is not None else None
        want_state = (
            mamba is not None and device_state is not None and mamba.host_slot(node) is None
        )
        swa_ranges = self._window_ranges(node, end) if self._core.swa is not None else ()
        if start >= end and not want_state and not swa_ranges:
            return None
        host_receipt = self._core.tier.lock(anchor)
        slots = self._core.alloc_host(end - start) if end > start else NO_SLOTS
        if slots is None:
            self._core.tier.unlock(host_receipt)
            return None
        # No host state slot to be had: the pages still go (the host hit then ends earlier).
        host_state = self._core.alloc_host_state() if want_state else None
        # Likewise without host SWA room: the window is then not restorable from the host.
        swa_tokens = sum(hi - lo for lo, hi in swa_ranges)
        host_swa = self._core.alloc_host_swa(swa_tokens) if swa_tokens else None
        if not len(slots) and host_state is None and host_swa is None:
            self._core.tier.unlock(host_receipt)
            return None
        device_receipt = self._core.device_tree.lock(node)
        moves: dict[str, PageMove] = {}
        if len(slots):
            device_slots = self._core.device_tree.prefix_slots(node)[start:end]
            moves[FULL] = PageMove(device=device_slots, host=slots)
        if host_swa is not None and self._core.swa is not None:
            prefix = self._core.device_tree.prefix_slots(node)
            window = torch.cat([prefix[lo:hi] for lo, hi in swa_ranges])
            moves[SWA] = PageMove(device=self._core.swa.allocator.translate(window), host=host_swa)
        else:
            swa_ranges = ()
        if host_state is not None and device_state is not None:
            moves[MAMBA] = PageMove(
                device=torch.tensor([device_state], dtype=torch.int64), host=host_state
            )
        pending = PendingWrite(
            key=key,
            start=start,
            host_slots=slots,
            device_receipt=device_receipt,
            host_receipt=host_receipt,
            host_state=host_state,
            host_swa=host_swa,
            swa_ranges=swa_ranges,
        )
        # Queued, not yet submitted: a temporary negative id until `_flush_writes` hands the
        # batch to the controller (one wake-up of its worker for the whole batch).
        self._unsent_ids -= 1
        temp_id = self._unsent_ids
        if not self._unsent:
            self._unsent_since = self._num_requests
        self._core.pending[temp_id] = pending
        self._unsent.append((temp_id, WriteOp(moves=moves)))
        if now or len(self._unsent) >= self._core.params.write_batch:
            return self.flush().get(temp_id)
        return temp_id

    def flush(self) -> dict[int, int]:
        """Submit every queued write, oldest first, in one burst (the controller's worker wakes
        once and merges them; a CPU controller runs the merged batch on this thread,
        `TierController.runs_inline`). A write the queue refuses is rolled back: its locks released,
        its host slots freed. Returns temporary id -> op id of the writes submitted."""
        unsent, self._unsent = self._unsent, []
        submitted: dict[int, int] = {}
        if unsent:
            self._core.counters.write_batches += 1
        op_ids = self._core.controller.submit_writes([op for _, op in unsent], inline=True)
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
        self._core.device_tree.unlock(pending.device_receipt)
        self._core.tier.unlock(pending.host_receipt)
        if len(pending.host_slots):
            self._core.host_allocator.free(pending.host_slots)
        if pending.host_state is not None:
            self._core.free_host_state(pending.host_state)
        if pending.host_swa is not None:
            self._core.free_host_swa(pending.host_swa)

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

    def _window_ranges(self, node: TreeNode, end: int) -> tuple[tuple[int, int], ...]:
        """SWA: the key ranges (node runs, ascending) of the last sliding window before `end`
        (whole pages; the path ending at device node `node`) whose SWA pages a write must copy:
        live on the device and without a host SWA copy yet. Empty when the window is not live
        on the device as a whole (a copy could never make a hit). Splits the node the window
        starts inside, so host SWA copies cover whole nodes. O(nodes in the window)."""
        swa = self._core.swa
        assert swa is not None, "_window_ranges on a tree without SWA"
        page = self._core.page_size
        lo = max(0, end - -(-swa.sliding_window // page) * page)
        ranges: list[tuple[int, int]] = []
        pos, probe = end, node
        while pos > lo:
            if probe.parent is None:
                break
            if not swa.is_live(probe):
                return ()
            first = pos - probe.num_tokens
            if first < lo:
                self._core.device_tree.split_node(probe, lo - first)  # probe keeps [lo, pos)
                first = lo
            if swa.host_copy(probe) is None:
                ranges.append((first, pos))
            pos = first
            probe = probe.parent
        return tuple(reversed(ranges))

    def commit_write(self, pending: PendingWrite, ack: Ack) -> None:
        self._core.device_tree.unlock(pending.device_receipt)
        state = pending.host_state
        if not ack.ok:
            self._core.tier.unlock(pending.host_receipt)
            if len(pending.host_slots):
                self._core.host_allocator.free(pending.host_slots)
            if state is not None:
                self._core.free_host_state(state)
            if pending.host_swa is not None:
                self._core.free_host_swa(pending.host_swa)
            return
        num = len(pending.host_slots)
        receipt = self._core.tier.commit_path(
            pending.host_receipt, pending.device_receipt.anchor, pending.key, pending.host_slots
        )
        mamba = self._core.mamba
        if (
            state is not None
            and mamba is not None
            and not self._core.tier.set_host(mamba, receipt.anchor, int(state.item()))
        ):
            self._core.free_host_state(state)
        swa_tokens = 0
        if pending.host_swa is not None:
            swa_tokens = len(pending.host_swa)
            self._core.commit_host_swa(
                receipt.anchor, len(pending.key), pending.swa_ranges, pending.host_swa
            )
        self._core.counters.written_tokens += num
        # The state moved with the pages even when the node had meanwhile got another one.
        self._core.counters.bytes_d2h += (
            num // self._core.page_size * self._core.page_bytes
            + (self._core.state_bytes if state is not None else 0)
            + swa_tokens // self._core.page_size * self._core.swa_page_bytes
        )
        if self._core.backups:
            # The window's SWA pages may lie before `start` (on pages stored before): the backup
            # then starts at the window so they go to storage too (stored pages are skipped).
            lo = min(pending.start, pending.swa_ranges[0][0]) if pending.swa_ranges else None
            self._backup(receipt, pending.key, pending.start if lo is None else lo, pending.start)
        else:
            self._core.tier.unlock(receipt)

    def _backup(
        self, receipt: HostReceipt, key: RadixKey, start: int, fresh: int | None = None
    ) -> None:
        """Queue host -> storage of the pages of `key` from `start` on (the prefix ending at the
        host-locked node); the lock passes to the backup until its ack. Pages before `fresh`
        (default `start`) were stored before: they are re-sent only for their SWA pages and
        the ack counts and announces only the pages from `fresh` on."""
        node = receipt.anchor
        keys = self._core.tier.page_keys(node)
        first = start // self._core.page_size
        page = self._core.page_size
        # NumPy on the host slots (a view): a torch floor_divide per backup costs more.
        pages = self._core.tier.host_slots(node).numpy()[start::page] // page
        host_pages: dict[str, list[int | None]] = {FULL: list[int | None](pages.tolist())}
        state_pages: tuple[int, ...] = ()
        if self._core.mamba is not None:
            # Each node of the range with a host state stores it beside its last page.
            states: list[int | None] = [None] * (len(keys) - first)
            end = len(keys) * self._core.page_size
            probe = node
            while probe.parent is not None and end > start:
                slot = self._core.mamba.host_slot(probe)
                if slot is not None:
                    states[end // self._core.page_size - 1 - first] = slot
                end -= probe.num_tokens
                probe = probe.parent
            host_pages[MAMBA] = states
            state_pages = tuple(i for i, s in enumerate(states) if s is not None)
        swa_pages: tuple[int, ...] = ()
        if self._core.swa is not None:
            host_pages[SWA] = self._backup_swa_pages(node, len(keys), first)
            swa_pages = tuple(i for i, p in enumerate(host_pages[SWA]) if p is not None)
        op = BackupOp(keys=keys[first:], host_pages=host_pages)
        parent = keys[first - 1] if first else None
        pending = PendingBackup(
            host_receipt=receipt,
            keys=keys[first:],
            parent_key=parent,
            key=key,
            state_pages=state_pages,
            swa_pages=swa_pages,
            fresh_from=(start if fresh is None else fresh) // self._core.page_size - first,
        )
        held = self._core.held_backups
        if held is not None:  # inside `poll`: sent together at its end
            held.append((op, pending))
            return
        try:
            op_id = self._core.controller.submit_backup(op)
        except QueueFull:
            self._core.tier.unlock(receipt)
            return
        self._core.pending[op_id] = pending

    def _backup_swa_pages(self, node: TreeNode, num_keys: int, first: int) -> list[int | None]:
        """SWA: per page of keys[first:num_keys] (the prefix ending at `node`), the host SWA
        page of the node holding it, or None where the node has no host SWA copy."""
        swa = self._core.swa
        assert swa is not None, "_backup_swa_pages on a tree without SWA"
        page = self._core.page_size
        pages: list[int | None] = [None] * (num_keys - first)
        start = first * page
        end = num_keys * page
        probe = node
        while probe.parent is not None and end > start:
            lo = end - probe.num_tokens
            host_swa = swa.host_copy(probe)
            if host_swa is not None:
                for at in range(max(lo, start), end, page):
                    pages[at // page - first] = int(host_swa[at - lo]) // page
            end = lo
            probe = probe.parent
        return pages

    def commit_backup(self, pending: PendingBackup, ack: Ack) -> None:
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        self._mark_stored(pending, done * self._core.page_size)
        self._core.tier.unlock(pending.host_receipt)
        fresh = min(pending.fresh_from, done)
        if done:
            stored_states = [i for i in pending.state_pages if i < done]
            stored_swa = [i for i in pending.swa_pages if i < done]
            # Only the last window before `done` makes a stored prefix's window restorable:
            # SWA pages further back name no prefix a prefetch could end at.
            window_from = done - self._core.window_pages() if self._core.swa is not None else done
            for i in stored_states + [i for i in stored_swa if i >= window_from]:
                self._know_stored_state(pending.keys[i])
            self._core.counters.backed_up_tokens += (done - fresh) * self._core.page_size
            self._core.counters.bytes_storage_set += (
                (done - fresh) * self._core.page_bytes
                + len(stored_states) * self._core.state_bytes
                + len(stored_swa) * self._core.swa_page_bytes
            )
        if done > fresh:
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
