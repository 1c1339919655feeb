"""Storage -> host prefetches of a `HierarchicalCache` (`TierPrefetcher`).

A prefetch brings the pages after the host prefix into new host pages, stopped by the prefetch
policy and by the controller at the first page it cannot restore. Each other component says how
far a prefetch may go (`prefetch_pages`: e.g. a Mamba tree only up to the deepest page whose
state this cache backed up, an SWA tree up to the deepest page whose last window's SWA pages it
backed up) and what it fetches with the pages (`plan_prefetch`: that state, those SWA pages).
What arrived is committed to the host tier (new off-device nodes past the tree's end); the
components' parts only once every page arrived (`commit_prefetch`), so a host hit into a short
prefetch ends where they are restorable, never further.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvstrata.hybrid_cache import (
    Ack,
    AckStatus,
    PrefetchOp,
    PrefetchPolicy,
    QueueFull,
)
from kvstrata.unified_radix_cache.components.transfer import TransferLeg
from kvstrata.unified_radix_cache.errors import ForeignNode
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.key_chain import chain_of
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.tier_core import (
    FULL,
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
        # The keyer's chain (`PageKeyer.chain`), compiled where it can be (key_chain.py).
        self._chain = chain_of(core.keyer)
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
        keyer = self._core.keyer
        # The chain goes on from the host prefix's last page key (the seed of the key's
        # namespace at the root). Unchecked hashing (`PageKeyer.chain`, `self._chain`): the
        # key's tokens were validated when it entered the cache, and the parent key is this
        # keyer's.
        parent = (
            self._core.tier.last_page_key(anchor)
            if start
            else keyer.seed(extra_key=key.extra_key, cache_salt=key.cache_salt)
        )
        tokens = key.tokens()[start : start + num_pages * page]
        first = self._probe_first_page(tokens[:page], parent)
        if first is False:
            self._core.counters.prefetches_skipped += 1
            return None
        if first is None:
            keys = self._chain(tokens, parent)
        else:  # the probe hashed the first page: the chain goes on from its key
            keys = [first, *self._chain(tokens[page:], first)]
        core = self._core
        for transfer in core.transfers.values():
            num_pages = transfer.prefetch_pages(core, anchor, start, keys[:num_pages])
            if num_pages == 0:
                core.counters.prefetches_skipped += 1
                return None
            keys = keys[:num_pages]
        num_pages = self._stored_pages(keys, num_pages)
        if num_pages == 0:
            core.counters.prefetches_skipped += 1
            return None
        keys = keys[:num_pages]
        receipt = core.tier.lock(anchor)
        slots = core.alloc_host(num_pages * page)
        legs: list[TransferLeg] = []
        for transfer in core.transfers.values():
            if slots is None:
                break
            leg = transfer.plan_prefetch(core, start, keys)
            if leg.size:
                # Without room for a component's part the pages could never make a hit: no
                # prefetch.
                leg.host = core.alloc_component_host(leg.name, leg.size)
                if leg.host is None:
                    core.host_allocator.free(slots)
                    slots = None
                    core.free_legs(tuple(legs))
                    break
            legs.append(leg)
        if slots is None:
            core.tier.unlock(receipt)
            core.counters.prefetches_skipped += 1
            return None
        # `tolist` makes new lists of ints: typed by annotation, not copied by a
        # `list[int | None](...)` call (which alone costs several times the list's).
        full: list[int | None] = (slots.numpy()[::page] // page).tolist()
        host_pages: dict[str, list[int | None]] = {FULL: full}
        for leg in legs:
            if leg.host is not None:
                unit = core.comp_page_tokens[leg.name]
                part: list[int | None] = (leg.host[::unit] // unit).tolist()
                host_pages[leg.name] = [None] * leg.first + part
        op = PrefetchOp(
            keys=keys,
            host_pages=host_pages,
            num_tokens=num_pages * page,
            policy=core.params.prefetch_policy,
            timeout=core.params.prefetch_timeout,
        )
        self._writer.flush()  # the controller wakes for the prefetch: send the writes along
        try:
            # Trusted: the tier's own page keys and host pages (of its allocators, none twice).
            op_id = core.controller.submit_prefetch(
                op, inline=wait_now and op.policy is PrefetchPolicy.WAIT_COMPLETE, trusted=True
            )
        except QueueFull:
            op_id = None
        if op_id is None:
            core.tier.unlock(receipt)
            core.host_allocator.free(slots)
            core.free_legs(tuple(legs))
            core.counters.prefetches_skipped += 1
            return None
        self._core.counters.prefetches_started += 1
        self._core.pending[op_id] = PendingPrefetch(
            key=key[: start + num_pages * page],
            start=start,
            host_slots=slots,
            host_receipt=receipt,
            legs=tuple(leg for leg in legs if leg.host is not None),
            keys=tuple(keys),
        )
        return op_id

    def _probe_first_page(
        self, first_page: npt.NDArray[np.int64], parent: bytes
    ) -> bytes | Literal[False] | None:
        """Whether a Full-only tree under a waiting policy may skip the prefetch unhashed:
        False when storage lacks the first page beyond the host prefix, so `_stored_pages`
        would find none. One page hashed instead of the whole rest of the key (most matches
        find nothing in storage beyond their hits). When the page is there, its key (the
        caller chains the rest from it: no page hashed twice); None when no probe applies."""
        core = self._core
        storage = core.controller.storage
        if (
            storage is None
            or core.params.prefetch_policy is PrefetchPolicy.BEST_EFFORT
            or core.transfers  # components with their own parts: they bound the prefetch first
        ):
            return None
        first = self._chain(first_page, parent)[0]
        # Trusted: a key of the tier's own keyer (bytes).
        if (
            storage.batch_exists([core.controller.group.storage_key(FULL, first)], trusted=True)
            == 0
        ):
            return False
        return first

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
        found = storage.batch_exists(
            [group.storage_key(FULL, k) for k in keys[:num_pages]], trusted=True
        )
        if found == 0 or not self._core.transfers:
            return found
        return num_pages

    def _prefetched_tokens(self, ack: Ack) -> int:
        done = ack.num_pages_done if ack.status is not AckStatus.FAILED else 0
        return done * self._core.page_size

    def _commit_prefetch(self, pending: PendingPrefetch, upto: int) -> int:
        """Hand host_slots[committed:upto] (arrived) to the tree, and the components' parts to
        the nodes ending at the key once every page arrived; returns tokens added."""
        got = upto - pending.committed
        key = pending.key[: pending.start + upto]
        pending.host_receipt = self._core.tier.commit(
            pending.host_receipt, key, pending.host_slots[pending.committed : upto]
        )
        pending.committed = upto
        self._keep_page_keys(pending, pending.start + upto)
        core = self._core
        moved = got // core.page_size * core.page_bytes
        if pending.legs and upto == len(pending.host_slots):
            # Every page arrived, so did the components' parts (the controller's restore rules).
            legs, pending.legs = pending.legs, ()
            end = pending.start + upto
            for leg in legs:
                host = leg.host
                assert host is not None
                core.transfers[leg.name].commit_prefetch(
                    core, leg, pending.host_receipt.anchor, end
                )
                leg.host = None  # the nodes hold it now (or it went back)
                moved += core.leg_bytes(leg, len(host))
        core.counters.storage_hit_tokens += got
        core.counters.bytes_storage_get += moved
        return got

    def _keep_page_keys(self, pending: PendingPrefetch, end: int) -> None:
        """Give the nodes without page keys that lie wholly in the prefetched range
        [start, end), walking up from the node ending at `end`, their keys from the
        prefetch's: the same chain `EventLog.page_keys` would hash (key[start:] chains from
        the key of the page before `start` on this very path, in this key's namespace), so a
        later backup or event hashes none of them again. A tree with events on has hashed them
        already: the host tier's `BlockStored` events of the commit name its nodes' pages
        before this runs (the same keys; those nodes are skipped). O(nodes)."""
        node = pending.host_receipt.anchor
        page = self._core.page_size
        if prefix_len(node) != end:  # not the node ending at the key: keep the lazy hashing
            return
        keys = pending.keys
        hi = end
        while node.parent is not None:
            lo = hi - node.num_tokens
            if lo < pending.start:
                break
            if node.page_keys is None and lo % page == 0 and hi % page == 0:
                node.page_keys = list(
                    keys[(lo - pending.start) // page : (hi - pending.start) // page]
                )
            hi = lo
            node = node.parent

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
        if pending.legs:
            # The components' parts never all arrived (then, for a state at the last page, no
            # page did either). Storage no longer holds them, or a fault hid them: forget their
            # keys, a later backup learns them again.
            legs, pending.legs = pending.legs, ()
            self._core.free_legs(legs)
            if not pending.stopped:
                for leg in legs:
                    for page_key in leg.keys:
                        self._core.stored_states.pop(page_key, None)
        self._core.tier.unlock(pending.host_receipt)
