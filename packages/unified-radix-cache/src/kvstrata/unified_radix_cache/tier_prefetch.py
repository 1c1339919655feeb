"""Storage -> host prefetches of a `HierarchicalCache` (`TierPrefetcher`).

A prefetch brings the pages after the host prefix into new host pages, stopped by the prefetch
policy and by the controller at the first page it cannot restore; a Mamba tree fetches only up
to the deepest page whose state this cache backed up, plus that state; an SWA tree fetches only
up to the deepest page whose last window's SWA pages this cache backed up, plus those SWA pages
(member "swa", None elsewhere). What arrived is committed to the host tier (new off-device
nodes past the tree's end); the window's SWA pages only once every page arrived, so a host hit
into a short prefetch ends where its window is restorable, never further.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import numpy.typing as npt
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
    SWA,
    UNTAKEN_PREFETCHES,
    PendingPrefetch,
    TierCore,
    prefix_len,
)
from kvstrata.unified_radix_cache.tier_writes import TierWriter


class TierPrefetcher:
    """The prefetch transfers of a `HierarchicalCache`, over its shared `core`; `writer`
    sends its queued writes along when a prefetch wakes the controller."""

    def __init__(self, core: TierCore, writer: TierWriter) -> None:
        self._core = core
        self._writer = writer
        # Prefetches a poll committed before their `finish`: op id -> tokens committed,
        # oldest first, at most UNTAKEN_PREFETCHES (dropped when `finish` takes them).
        self._untaken_prefetches: OrderedDict[int, int] = OrderedDict()

    def finish(self, op_id: int) -> int:
        """Wait for prefetch `op_id` as its policy says (wait_complete: its ack; timeout: up to
        the allowance; best_effort: not at all), stop it, and commit the pages that arrived to
        the host tier. Returns the tokens committed now (more may be committed by a later
        `poll` when the ack reports pages that were still landing); when a `poll` (e.g. in
        another call's `match_prefix`, `evict_device` or `start_load_back`) already committed
        the whole prefetch, the tokens that commit added (the record is dropped: a second call
        raises; the newest `UNTAKEN_PREFETCHES` such records are kept). Raises ForeignNode for
        an id that is neither in flight nor such a record. Re-match afterwards."""
        done = self._untaken_prefetches.pop(op_id, None)
        if done is not None:
            return done
        pending = self._core.pending.get(op_id)
        if not isinstance(pending, PendingPrefetch):
            raise ForeignNode(f"op {op_id} is not a prefetch of this cache in flight")
        pending.taken = True
        policy = self._core.params.prefetch_policy
        start = time.perf_counter()
        ack: Ack | None = None
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            ack = self._core.controller.wait(op_id, self._core.params.transfer_timeout_s)
        elif policy is PrefetchPolicy.TIMEOUT:
            allowance = self._core.params.prefetch_timeout.seconds(len(pending.host_slots))
            ack = self._core.controller.wait(op_id, allowance)
        self._core.counters.transfer_wait_seconds += time.perf_counter() - start
        if ack is not None:
            before = pending.committed
            self._core.on_ack(ack)
            return pending.committed - before
        pending.stopped = True
        progress = self._core.controller.stop_prefetch(op_id)
        ready = progress.num_pages_ready * self._core.page_size
        if ready > pending.committed:
            return self._commit_prefetch(pending, ready)
        return 0

    def start(
        self, key: RadixKey, anchor: TreeNode, end: int, *, wait_now: bool = False
    ) -> int | None:
        """Prefetch `key[start:end]` from storage into new host pages, `start` the end of the
        host prefix ending at `anchor` (host values stay prefix-closed). A Mamba tree fetches
        only up to the deepest page of the range whose boundary state a backup stored, plus
        that state into a new host state slot (pages past it could never be a hit). `wait_now`:
        the caller takes it at once (`begin_request`): under wait_complete, a controller that
        `runs_inline` (CPU) runs it on this thread instead of a worker round trip."""
        page = self._core.page_size
        start = prefix_len(anchor)
        share = self._core.controller.params.prefetch_host_share
        limit = (
            int(share * self._core.host_allocator.num_pages)
            - self._core.controller.prefetch_inflight_pages()[FULL]
        )
        num_pages = min((end - start) // page, limit)
        if num_pages <= 0:
            self._core.counters.prefetches_skipped += 1
            return None
        parent = self._core.tier.page_keys(anchor)[-1] if start else None
        tokens = key.tokens()[start : start + num_pages * page]
        if self._probe_first_page(key, tokens[:page], parent):
            self._core.counters.prefetches_skipped += 1
            return None
        keys = self._core.keyer.page_keys(
            tokens, extra_key=key.extra_key, cache_salt=key.cache_salt, parent=parent
        )
        state_key: bytes | None = None
        if self._core.mamba is not None:
            known = self._core.stored_states
            num_pages = next((i + 1 for i in range(num_pages - 1, -1, -1) if keys[i] in known), 0)
            if num_pages == 0:
                self._core.counters.prefetches_skipped += 1
                return None
            keys = keys[:num_pages]
            state_key = keys[-1]
        swa_first = num_pages
        if self._core.swa is not None:
            num_pages = self._swa_prefetch_pages(anchor, start, keys)
            if num_pages == 0:
                self._core.counters.prefetches_skipped += 1
                return None
            keys = keys[:num_pages]
            swa_first = max(0, num_pages - self._core.window_pages())
        num_pages = self._stored_pages(keys, num_pages)
        if num_pages == 0:
            self._core.counters.prefetches_skipped += 1
            return None
        keys = keys[:num_pages]
        receipt = self._core.tier.lock(anchor)
        slots = self._core.alloc_host(num_pages * page)
        host_state = None
        if slots is not None and state_key is not None:
            host_state = self._core.alloc_host_state()
            if host_state is None:
                self._core.host_allocator.free(slots)
                slots = None
        host_swa = None
        if slots is not None and swa_first < num_pages:
            # Without room for the window the pages could never make a hit: no prefetch.
            host_swa = self._core.alloc_host_swa((num_pages - swa_first) * page)
            if host_swa is None:
                self._core.host_allocator.free(slots)
                slots = None
        if slots is None:
            self._core.tier.unlock(receipt)
            self._core.counters.prefetches_skipped += 1
            return None
        host_pages: dict[str, list[int | None]] = {
            FULL: list[int | None]((slots.numpy()[::page] // page).tolist())
        }
        if host_state is not None:
            host_pages[MAMBA] = [None] * (num_pages - 1) + [int(host_state.item())]
        if host_swa is not None:
            host_pages[SWA] = [None] * swa_first + list[int | None](
                (host_swa[::page] // page).tolist()
            )
        op = PrefetchOp(
            keys=keys,
            host_pages=host_pages,
            num_tokens=num_pages * page,
            policy=self._core.params.prefetch_policy,
            timeout=self._core.params.prefetch_timeout,
        )
        self._writer.flush()  # the controller wakes for the prefetch: send the writes along
        try:
            op_id = self._core.controller.submit_prefetch(
                op, inline=wait_now and op.policy is PrefetchPolicy.WAIT_COMPLETE
            )
        except QueueFull:
            op_id = None
        if op_id is None:
            self._core.tier.unlock(receipt)
            self._core.host_allocator.free(slots)
            if host_state is not None:
                self._core.free_host_state(host_state)
            if host_swa is not None:
                self._core.free_host_swa(host_swa)
            self._core.counters.prefetches_skipped += 1
            return None
        self._core.counters.prefetches_started += 1
        self._core.pending[op_id] = PendingPrefetch(
            key=key[: start + num_pages * page],
            start=start,
            host_slots=slots,
            host_receipt=receipt,
            host_state=None if host_state is None else int(host_state.item()),
            state_key=state_key,
            host_swa=host_swa,
            swa_from=start + swa_first * page,
            swa_keys=tuple(keys[swa_first:]) if host_swa is not None else (),
        )
        return op_id

    def _probe_first_page(
        self, key: RadixKey, first_page: npt.NDArray[np.int64], parent: bytes | None
    ) -> bool:
        """Whether a Full-only tree under a waiting policy may skip the prefetch unhashed:
        storage lacks the first page beyond the host prefix, so `_stored_pages` would find
        none. One page hashed instead of the whole rest of the key (most matches find nothing
        in storage beyond their hits); when the page is there the caller hashes them all."""
        core = self._core
        storage = core.controller.storage
        if (
            storage is None
            or core.params.prefetch_policy is PrefetchPolicy.BEST_EFFORT
            or core.mamba is not None
            or core.swa is not None
        ):
            return False
        first = core.keyer.page_keys(
            first_page, extra_key=key.extra_key, cache_salt=key.cache_salt, parent=parent
        )
        return storage.batch_exists([core.controller.group.storage_key(FULL, first[0])]) == 0

    def _stored_pages(self, keys: list[bytes], num_pages: int) -> int:
        """How many of the `num_pages` pages to prefetch. When the request will wait for the
        prefetch anyway (wait_complete, timeout), ask storage here how many leading full pages
        it holds: none, and no prefetch starts (no host slots taken, no worker round trip for
        nothing); fewer, and a Full-only tree fetches only those (the worker would stop at the
        first missing page). The worker checks again (and the checksums). Under best_effort the
        request does not wait, so neither does this: the worker asks."""
        storage = self._core.controller.storage
        if storage is None or self._core.params.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return num_pages
        group = self._core.controller.group
        found = storage.batch_exists([group.storage_key(FULL, k) for k in keys[:num_pages]])
        if found == 0 or (self._core.mamba is None and self._core.swa is None):
            return found
        return num_pages

    def _swa_prefetch_pages(self, anchor: TreeNode, start: int, keys: list[bytes]) -> int:
        """SWA: the longest run of `keys` (the pages after the host prefix ending at `anchor`,
        at `start`) whose last window's SWA pages a backup of this cache stored, as far as it
        knows; a window reaching before `start` needs the host prefix's window restorable
        (pages past that could never be a hit). O(len(keys) + nodes in the window)."""
        known = self._core.stored_states
        window = self._core.window_pages()
        assert self._core.swa is not None
        before_ok = start == 0 or self._core.swa.window_restorable(anchor)
        best = run = 0
        for e, page_key in enumerate(keys, start=1):
            run = run + 1 if page_key in known else 0
            if run >= window or (run == e and before_ok):
                best = e
        return best

    def _prefetched_tokens(self, ack: Ack) -> int:
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        return done * self._core.page_size

    def _commit_prefetch(self, pending: PendingPrefetch, upto: int) -> int:
        """Hand host_slots[committed:upto] (arrived) to the tree, and a Mamba prefetch's state
        to the node ending at the key once every page arrived; returns tokens added."""
        got = upto - pending.committed
        key = pending.key[: pending.start + upto]
        pending.host_receipt = self._core.tier.commit(
            pending.host_receipt, key, pending.host_slots[pending.committed : upto]
        )
        pending.committed = upto
        state = pending.host_state
        got_state = state is not None and upto == len(pending.host_slots)
        if got_state and state is not None:
            pending.host_state = None
            assert self._core.mamba is not None
            if not self._core.tier.set_host(self._core.mamba, pending.host_receipt.anchor, state):
                self._core.free_host_state(torch.tensor([state], dtype=torch.int64))
        host_swa = pending.host_swa
        got_swa = 0
        if host_swa is not None and upto == len(pending.host_slots):
            # Every page arrived, so did the window's SWA pages (the controller's window rule).
            pending.host_swa = None
            end = pending.start + upto
            node = self._split_window(pending.host_receipt.anchor, end, pending.swa_from)
            self._core.commit_host_swa(node, end, ((pending.swa_from, end),), host_swa)
            got_swa = len(host_swa)
        self._core.counters.storage_hit_tokens += got
        self._core.counters.bytes_storage_get += (
            got // self._core.page_size * self._core.page_bytes
            + (self._core.state_bytes if got_state else 0)
            + got_swa // self._core.page_size * self._core.swa_page_bytes
        )
        return got

    def _split_window(self, node: TreeNode, end: int, lo: int) -> TreeNode:
        """Split the node (on the path ending at `node`, at `end`) that key position `lo` falls
        inside, so the nodes of key[lo:end] are whole runs; returns `node` (it keeps its tail)."""
        pos, probe = end, node
        while pos > lo and probe.parent is not None:
            first = pos - probe.num_tokens
            if first < lo:
                self._core.device_tree.split_node(probe, lo - first)  # probe keeps [lo, pos)
                break
            pos = first
            probe = probe.parent
        return node

    def commit(self, pending: PendingPrefetch, ack: Ack) -> None:
        done = self._prefetched_tokens(ack)
        if done < len(pending.host_slots):
            self._core.counters.short_prefetches += 1
        if done > pending.committed:
            self._commit_prefetch(pending, done)
        if not pending.taken:
            # Committed by a poll before its finish_prefetch: keep the count for it.
            untaken = self._untaken_prefetches
            untaken[ack.op_id] = pending.committed
            while len(untaken) > UNTAKEN_PREFETCHES:
                untaken.popitem(last=False)
        rest = pending.host_slots[max(done, pending.committed) :]
        if len(rest):
            self._core.host_allocator.free(rest)
        if pending.host_state is not None:
            # The state never arrived (BOUNDARY: then no page did either). Storage no longer
            # holds it, or a fault hid it: forget it, a later backup learns it again.
            self._core.free_host_state(torch.tensor([pending.host_state], dtype=torch.int64))
            pending.host_state = None
            if pending.state_key is not None and not pending.stopped:
                self._core.stored_states.pop(pending.state_key, None)
        if pending.host_swa is not None:
            # The window's SWA pages never all arrived: as for a Mamba state, forget them.
            self._core.free_host_swa(pending.host_swa)
            pending.host_swa = None
            if not pending.stopped:
                for page_key in pending.swa_keys:
                    self._core.stored_states.pop(page_key, None)
        self._core.tier.unlock(pending.host_receipt)
