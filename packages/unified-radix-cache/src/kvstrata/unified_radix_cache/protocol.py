"""`PrefixCache`: the one object an engine holds, whatever tiers exist.

Two classes implement it: `DeviceCache` (device_cache.py: a `UnifiedRadixCache` and the
allocators it frees into) and `HierarchicalCache` (hierarchy.py: the same tree with a host tier
and, optionally, storage). An engine written against this protocol runs unchanged on both:

    req = cache.begin_request(key)             match at most len(key) - 1 tokens and lock them;
                                               req.hit says where they came from, and
                                               req.hit.load.wait_layer(i) before layer i reads
    slots = cache.alloc_tokens(n)              allocate-or-evict n KV slots (None: no room)
    req.extend(slots)                          ... the forward writes their KV ...
    cache.cache_unfinished_request(req)        chunked prefill: the tree keeps what has KV
    cache.cache_finished_request(req)          insert, free duplicates, unlock
    cache.abort_request(req)                   or: drop it, insert nothing
    cache.release(slots)                       KV slots allocated but handed to no request

A request's slots by position (`req.kv_indices`):

    0            device_len      device_len + host_len + storage_len = cached_len
    |-- device --|-- loaded from host / storage --|-- the request's own slots --|
                 (arrived per layer: req.hit.load)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvstrata.unified_radix_cache.results import LayerWait, PrefixHit

__all__ = ["LayerWait", "PrefixCache", "PrefixHit"]

if TYPE_CHECKING:
    import torch

    from kvstrata.unified_radix_cache.key import RadixKey
    from kvstrata.unified_radix_cache.request import CacheRequest
    from kvstrata.unified_radix_cache.tiers import TierCounters


class PrefixCache(Protocol):
    """The request-level prefix cache an engine drives (see the module docstring).

    Every method runs on the scheduler thread. Slots returned by `alloc_tokens` /
    `alloc_state` are the caller's until handed to a request (`req.extend`, `req.state_slot`)
    or given back (`release`); a request's slots are the cache's to free once it is finished or
    aborted. Nothing here raises on a full device: allocation returns None instead.
    """

    @property
    def page_size(self) -> int:
        """Tokens per page: only whole pages are cached and matched."""
        ...

    @property
    def evicted_tokens(self) -> int:
        """Full-attention tokens evicted from the device so far (cumulative; every cause)."""
        ...

    def begin_request(self, key: RadixKey, *, priority: int = 0) -> CacheRequest:
        """Match at most `len(key) - 1` tokens (an engine computes at least the last one) on
        every tier, bring what is on a lower tier to the device, and lock the match. The request
        starts with `kv_indices[:cached_len]` the cache's slots; `hit` says which tier each
        part came from; with Mamba layers `state_slot` is the request's own copy of the
        matched state. Mutates access times, counters, and may evict (device room for a load)."""
        ...

    def alloc_tokens(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` KV slots (a whole number of pages for a paged allocator; SWA slots in
        step), evicting unlocked cached data when short. None when even eviction cannot make
        room (what was evicted stays evicted)."""
        ...

    def alloc_state(self) -> torch.Tensor | None:
        """One Mamba state slot for a request that matched none, evicting an unlocked cached
        state when the pool is out. None when none can go. Only for trees with Mamba."""
        ...

    def cache_unfinished_request(self, req: CacheRequest) -> None:
        """Chunked prefill: the cache keeps the whole pages of `req` that have KV (and, with
        Mamba and an aligned length, a copy of its state, evicting one cached state if the
        pool is out), frees the request's duplicates and moves its lock to the new prefix.
        `req.kv_indices[:cached_len]` become the cache's slots. The request keeps running."""
        ...

    def cache_finished_request(self, req: CacheRequest) -> None:
        """The request is done: insert its whole pages (and its state), free its duplicates,
        its unaligned tail and a state not adopted, unlock. A tiered cache applies its write
        policy to what it now holds. `req` is finished afterwards."""
        ...

    def abort_request(self, req: CacheRequest) -> None:
        """Drop `req` without inserting: free its own slots and state, unlock."""
        ...

    def release(self, slots: torch.Tensor) -> None:
        """Give back KV slots from `alloc_tokens` that no request holds (e.g. the padding of a
        last partial page)."""
        ...

    def transfer_counters(self) -> TierCounters | None:
        """The lower tiers' counters (bytes moved, waits, failures), None without tiers."""
        ...
