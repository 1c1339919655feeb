"""`DeviceRoom`: device slots for a `HierarchicalCache` (new tokens, load-backs), evicting
through the write policy when short.

Device eviction under write_back first writes each leaf to the host and waits for the copy, so
making room depends on the writer (tier_writes.py); a load-back allocates through here.
"""

from __future__ import annotations

import time

import torch

from kvstrata.unified_radix_cache.paths import key_of
from kvstrata.unified_radix_cache.results import EvictRequest
from kvstrata.unified_radix_cache.tier_core import TierCore
from kvstrata.unified_radix_cache.tier_writes import TierWriter
from kvstrata.unified_radix_cache.tiers import WritePolicy


class DeviceRoom:
    """Device allocation and eviction of one `HierarchicalCache`: `core` holds the tree and
    the counters, `writer` the write-back copies an eviction waits for."""

    def __init__(self, core: TierCore, writer: TierWriter) -> None:
        self._core = core
        self._writer = writer

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens (or all that is evictable), from the device
        leaves in the tree's policy order: a leaf with a host copy goes off the device and stays
        in the tree, one without leaves it. Under write_back each leaf is first written to the
        host (the eviction waits for the copy). Writes still in flight hold device locks, so
        when short this waits for them and tries again. Never raises on a slow write: a write
        not acknowledged within `transfer_timeout_s` stays in flight (its late ack commits at
        `poll`), its source stays on the device, and the eviction returns what it freed so
        far (under write_back it stops at that leaf: an unsaved leaf is never dropped instead).
        Returns the tokens freed."""
        self._core.poll()
        freed = self._evict_device_once(num_tokens)
        if freed < num_tokens and self._writer.wait_all():
            freed += self._evict_device_once(num_tokens - freed)
        return freed

    def _evict_device_once(self, num_tokens: int) -> int:
        tree = self._core.device_tree
        if self._core.params.write_policy is not WritePolicy.WRITE_BACK:
            return tree.evict(EvictRequest.full(num_tokens)).num_evicted()
        heap = self._core.device_full.heap
        assert heap is not None, "a bound FullComponent has its heap"
        freed = 0
        while freed < num_tokens:
            node = heap.peek()
            if node is None:
                break
            op_id = self._writer.write(key_of(tree, node), node, now=True)
            if op_id is not None:
                began = time.perf_counter()
                ack = self._core.controller.wait(op_id, self._core.params.transfer_timeout_s)
                self._core.counters.transfer_wait_seconds += time.perf_counter() - began
                if ack is None:
                    # Still in flight: the leaf stays device-locked, and evicting on would
                    # drop the next leaf unsaved. Its late ack commits at `poll`.
                    self._core.counters.transfer_timeouts += 1
                    break
                self._core.on_ack(ack)
            # The write unlocked the leaf again, with its old policy key: it is the heap top.
            got = tree.evict(EvictRequest.full(min(num_tokens - freed, len(node.value))))
            if got.num_evicted() == 0:
                break
            freed += got.num_evicted()
        return freed

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Device KV slots, evicting when short: Full through the write policy
        (`evict_device`), then every other token component (SWA, allocated in step) its own
        shortfall. None when even that leaves no room."""
        allocator = self._core.device_full.allocator
        alloc = getattr(allocator, "alloc", None)
        assert alloc is not None, "the device tree's allocator must allocate (SlotSource)"
        slots = alloc(num_tokens)
        if not isinstance(slots, torch.Tensor):
            short = num_tokens - self._core.device_full.free_size()
            if short > 0:
                self.evict(short)
            rest = {
                c.name: num_tokens - free
                for c in self._core.device_tree.components[1:]
                if c.unit == "tokens" and (free := c.free_size()) < num_tokens
            }
            if rest:
                self._core.device_tree.evict(EvictRequest(targets=rest))
            slots = alloc(num_tokens)
        return slots if isinstance(slots, torch.Tensor) else None
