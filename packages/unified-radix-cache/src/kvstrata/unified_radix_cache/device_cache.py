"""`DeviceCache`: the `PrefixCache` of a device-only tree (protocol.py).

A `UnifiedRadixCache` decides what to keep; the allocators hand out what it frees. The engine
needs both for one request (allocate, or evict and allocate again), so this class joins them:
the tree's request life cycle (request.py) plus allocate-or-evict. Eviction is generic over the
tree's components: every component counted in tokens (Full, SWA: allocated in step) is asked
for its own shortfall, the state component (Mamba) for one state.

Cost: nothing over the tree's own calls on the hit path; allocation adds one eviction call
only when the allocator is short.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvstrata.unified_radix_cache.components.base import TreeComponent
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.key import RadixKey
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import EvictRequest
from kvstrata.unified_radix_cache.tiers import TierCounters
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

#: The `unit` of a component holding one state per node (its pool is allocated per request).
STATES = "states"


class SlotSource(Protocol):
    """What allocate-or-evict needs of an allocator (`kvstrata.allocator`'s paged, SWA and
    Mamba allocators fit)."""

    def alloc(self, need_size: int, /) -> torch.Tensor | None: ...

    def available_size(self) -> int: ...


class DeviceCache:
    """The device-only `PrefixCache`: `tree` and the allocators its components free into.

    `kv_allocator`: the allocator of the Full component (an SWA allocator hands out SWA slots
    in step). `state_allocator`: that of the tree's state component (Mamba), required exactly
    when the tree has one. InvalidConfig otherwise, before anything changes.
    """

    def __init__(
        self,
        tree: UnifiedRadixCache,
        *,
        kv_allocator: SlotSource,
        state_allocator: SlotSource | None = None,
    ) -> None:
        states = [c for c in tree.components if c.unit == STATES]
        if len(states) > 1:
            raise InvalidConfig(f"at most one state component per tree, got {len(states)}")
        if bool(states) != (state_allocator is not None):
            raise InvalidConfig("state_allocator is required for a tree with states, and only then")
        self.tree = tree
        self.kv_allocator = kv_allocator
        self.state_allocator = state_allocator
        self._full = tree.components[0]
        self._token_components: tuple[TreeComponent, ...] = tuple(
            c for c in tree.components if c.unit != STATES
        )
        self._states: TreeComponent | None = states[0] if states else None

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def evicted_tokens(self) -> int:
        return self._full.evicted_total

    def begin_request(self, key: RadixKey, *, priority: int = 0) -> CacheRequest:
        """The tree's `begin_request` (the matched state is copied into the request's own slot):
        everything comes from the device, `req.hit.load` is None."""
        return self.tree.begin_request(key, priority=priority, copy_state=self._states is not None)

    def alloc_tokens(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.kv_allocator.alloc(num_tokens)
        if slots is not None:
            return slots
        targets = {
            c.name: num_tokens - free
            for c in self._token_components
            if (free := c.free_size()) < num_tokens
        }
        if targets:
            self.tree.evict(EvictRequest(targets=targets))
        return self.kv_allocator.alloc(num_tokens)

    def alloc_state(self) -> torch.Tensor | None:
        source, states = self.state_allocator, self._states
        if source is None or states is None:
            raise InvalidConfig("alloc_state on a tree without a state component")
        slot = source.alloc(1)
        if slot is None:
            self.tree.evict(EvictRequest(targets={states.name: 1}))
            slot = source.alloc(1)
        return slot

    def ensure_state_room(self, req: CacheRequest) -> None:
        """Before a chunk's insert keeps a copy of `req`'s state: one free state slot, evicting
        another cached state if the pool is out (never the request's own or its locked match)."""
        states = self._states
        if states is not None and req.state_slot is not None and states.free_size() < 1:
            self.tree.evict(EvictRequest(targets={states.name: 1}))

    def cache_unfinished_request(self, req: CacheRequest) -> None:
        self.ensure_state_room(req)
        self.tree.cache_unfinished_request(req)

    def cache_finished_request(self, req: CacheRequest) -> None:
        self.tree.cache_finished_request(req)

    def abort_request(self, req: CacheRequest) -> None:
        self.tree.abort_request(req)

    def release(self, slots: torch.Tensor) -> None:
        self.tree.free_slots(self._full.name, slots)

    def transfer_counters(self) -> TierCounters | None:
        return None

    def check_integrity(self, held: dict[str, int] | None = None) -> None:
        """The tree's check (free + evictable + protected + `held` == capacity per pool)."""
        self.tree.check_integrity(held)
