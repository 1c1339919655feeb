"""Storage -> host prefetches of a `HierarchicalCache` (`TierPrefetches`).

A prefetch brings the pages after the host prefix into new host pages, stopped by the prefetch
policy and by the controller at the first page it cannot restore; a Mamba tree fetches only up
to the deepest page whose state this cache backed up, plus that state. What arrived is
committed to the host tier (new off-device nodes past the tree's end).
"""

from __future__ import annotations

import time

import torch

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    PrefetchOp,
    PrefetchPolicy,
    QueueFull,
)
from kvstrata.unified_radix_cache.errors import ForeignNode
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
    MAMBA,
    PendingPrefetch,
    TierCore,
    prefix_len,
)


class TierPrefetches(TierCore):
    """The prefetch transfers of a `HierarchicalCache`."""

    def finish_prefetch(self, op_id: int) -> int:
        """Wait for prefetch `op_id` as its policy says (wait_complete: its ack; timeout: up to
        the allowance; best_effort: not at all), stop it, and commit the pages that arrived to
        the host tier. Returns the tokens committed now (more may be committed by a later
        `poll` when the ack reports pages that were still landing). Re-match afterwards."""
        pending = self._pending.get(op_id)
        if not isinstance(pending, PendingPrefetch):
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
        pending.stopped = True
        progress = self.controller.stop_prefetch(op_id)
        ready = progress.num_pages_ready * self.page_size
        if ready > pending.committed:
            return self._commit_prefetch(pending, ready)
        return 0

    def _start_prefetch(self, key: RadixKey, anchor: TreeNode, end: int) -> int | None:
        """Prefetch `key[start:end]` from storage into new host pages, `start` the end of the
        host prefix ending at `anchor` (host values stay prefix-closed). A Mamba tree fetches
        only up to the deepest page of the range whose boundary state a backup stored, plus
        that state into a new host state slot (pages past it could never be a hit)."""
        page = self.page_size
        start = prefix_len(anchor)
        share = self.controller.params.prefetch_host_share
        limit = (
            int(share * self.host_allocator.num_pages)
            - self.controller.prefetch_inflight_pages()[FULL]
        )
        num_pages = min((end - start) // page, limit)
        if num_pages <= 0:
            self.counters.prefetches_skipped += 1
            return None
        parent = self.tier.page_keys(anchor)[-1] if start else None
        keys = self.keyer.page_keys(
            key.tokens()[start : start + num_pages * page],
            extra_key=key.extra_key,
            cache_salt=key.cache_salt,
            parent=parent,
        )
        state_key: bytes | None = None
        if self._mamba is not None:
            known = self._stored_states
            num_pages = next((i + 1 for i in range(num_pages - 1, -1, -1) if keys[i] in known), 0)
            if num_pages == 0:
                self.counters.prefetches_skipped += 1
                return None
            keys = keys[:num_pages]
            state_key = keys[-1]
        receipt = self.tier.lock(anchor)
        slots = self._alloc_host(num_pages * page)
        host_state = None
        if slots is not None and state_key is not None:
            host_state = self._alloc_host_state()
            if host_state is None:
                self.host_allocator.free(slots)
                slots = None
        if slots is None:
            self.tier.unlock(receipt)
            self.counters.prefetches_skipped += 1
            return None
        host_pages: dict[str, list[int | None]] = {
            FULL: list[int | None]((slots[::page] // page).tolist())
        }
        if host_state is not None:
            host_pages[MAMBA] = [None] * (num_pages - 1) + [int(host_state.item())]
        op = PrefetchOp(
            keys=keys,
            host_pages=host_pages,
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
            if host_state is not None:
                self._free_host_state(host_state)
            self.counters.prefetches_skipped += 1
            return None
        self.counters.prefetches_started += 1
        self._pending[op_id] = PendingPrefetch(
            key=key[: start + num_pages * page],
            start=start,
            host_slots=slots,
            host_receipt=receipt,
            host_state=None if host_state is None else int(host_state.item()),
            state_key=state_key,
        )
        return op_id

    def _prefetched_tokens(self, ack: Ack) -> int:
        return (ack.num_pages_done if ack.status is not AckStatus.FAILED else 0) * self.page_size

    def _commit_prefetch(self, pending: PendingPrefetch, upto: int) -> int:
        """Hand host_slots[committed:upto] (arrived) to the tree, and a Mamba prefetch's state
        to the node ending at the key once every page arrived; returns tokens added."""
        got = upto - pending.committed
        key = pending.key[: pending.start + upto]
        pending.host_receipt = self.tier.commit(
            pending.host_receipt, key, pending.host_slots[pending.committed : upto]
        )
        pending.committed = upto
        state = pending.host_state
        got_state = state is not None and upto == len(pending.host_slots)
        if got_state and state is not None:
            pending.host_state = None
            if not self.tier.set_host_state(pending.host_receipt.anchor, state):
                self._free_host_state(torch.tensor([state], dtype=torch.int64))
        self.counters.storage_hit_tokens += got
        self.counters.bytes_storage_get += got // self.page_size * self._page_bytes + (
            self._state_bytes if got_state else 0
        )
        return got

    def _prefetch_acked(self, pending: PendingPrefetch, ack: Ack) -> None:
        done = self._prefetched_tokens(ack)
        if done < len(pending.host_slots):
            self.counters.short_prefetches += 1
        if done > pending.committed:
            self._commit_prefetch(pending, done)
        rest = pending.host_slots[max(done, pending.committed) :]
        if len(rest):
            self.host_allocator.free(rest)
        if pending.host_state is not None:
            # The state never arrived (BOUNDARY: then no page did either). Storage no longer
            # holds it, or a fault hid it: forget it, a later backup learns it again.
            self._free_host_state(torch.tensor([pending.host_state], dtype=torch.int64))
            pending.host_state = None
            if pending.state_key is not None and not pending.stopped:
                self._stored_states.pop(pending.state_key, None)
        self.tier.unlock(pending.host_receipt)
