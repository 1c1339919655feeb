"""`ReplayEngine`: drive requests through a memory system the way an inference engine does.

The engine holds one `unified_radix_cache.PrefixCache` (`system.cache`, or `tiers.cache` with a
host tier and storage) and never asks which it is. Per request, one at a time (a scheduler
with a batch of one):

    1. match    cache.begin_request(key): match at most N-1 tokens (an engine computes at least
    2. lock     one token, so an N-token prompt reuses at most N-1 tokens, in whole pages) on
                every tier, bring lower-tier hits to the device and lock the match, so the hit
                cannot be evicted under the request. With Mamba layers the matched state is
                copied into the request's own slot.
    3. alloc    cache.alloc_tokens: KV slots for the N - hit new tokens, in whole pages,
                evicting the shortfall (never the locked hit) when the allocator is short.
    4. forward  write K and V of the new tokens into every attention layer (and the Mamba
                state at the last page boundary): real pool writes of deterministic values.
    5. finish   cache.release the slots of the last partial page (the cache keeps whole pages
                only), then cache.cache_finished_request: insert the whole pages, free the
                duplicates of what the cache already had, unlock (and, with tiers, apply the
                write policy).

A Mamba state can be cached only where a node ends, so the stand-in forward checkpoints the
state at the last page boundary. A prompt of whole pages is prefilled as two chunks, with
cache.cache_unfinished_request at N - P, so that a repeat of the prompt (which may reuse only
N - P tokens) finds a state there too. Sliding-window layers keep all their SWA slots until
the tree evicts them: the replay prefills and does not decode, so nothing slides out of the
window while a request runs.

Slots of one request, by position in the prompt (P = page size):

    0          hit                    stored = N rounded down to P     N    N rounded up
    |-- tree --|------------ new slots (allocated in step 3) ---------------|....|
               |-- inserted, or freed as duplicates --|-- tail: freed by the engine --|

The values written are described in `forward.py`. With `verify=True`, every hit is read back
from the pools and compared with them before the request writes anything, so a slot the tree
hands out for the wrong tokens fails loudly (KVMismatch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from kvstrata.build import MemorySystem
from kvstrata.build.tiers import TieredSystem
from kvstrata.replay.errors import CapacityTooSmall, ReplayOptionError
from kvstrata.replay.forward import StandInForward
from kvstrata.replay.request import ReplayRequest
from kvstrata.replay.stats import ReplayCounters, ReplayStats, TierStats
from kvstrata.unified_radix_cache import PrefixCache, RadixKey, TierCounters

#: What `run` calls every `progress_every` requests and at the end: requests done so far.
ProgressCallback = Callable[[int], None]


class StepResult(NamedTuple):
    """What one request did: its prompt length, usable hit, tokens written and tokens evicted."""

    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    evicted_tokens: int


class UnboundedCapacity(NamedTuple):
    """A budget under which a replay never evicts (see `unbounded_capacity`)."""

    capacity_tokens: int
    mamba_slots: int


def unbounded_capacity(requests: Sequence[ReplayRequest], *, page_size: int) -> UnboundedCapacity:
    """Room for every prompt of `requests` at once, so no request ever evicts.

    KV: the sum of the page-rounded prompt lengths (the tree never holds more than the distinct
    pages, and a running request adds at most its own pages on top). Mamba states: two per
    request (a prompt of whole pages caches one at each of its two chunks) plus the running
    request's slot, plus one spare.
    """
    if page_size < 1:
        raise ReplayOptionError(f"page_size must be >= 1, got {page_size}")
    tokens = sum(-(-r.num_tokens // page_size) * page_size for r in requests)
    return UnboundedCapacity(
        capacity_tokens=max(tokens, page_size), mamba_slots=2 * len(requests) + 2
    )


class ReplayEngine:
    """Replays requests through `system` (a `kvstrata.build.MemorySystem`) one at a time.

    Its `counters` (a `ReplayCounters`, read by `ReplayCollector` and `stats()`) accumulate
    across `run` calls until `reset_counters()`. The tree keeps its contents between runs, so a
    second `run` over the same requests measures a warm cache; `system.reset()` empties it.
    """

    def __init__(
        self, system: MemorySystem, *, verify: bool = False, tiers: TieredSystem | None = None
    ) -> None:
        """`verify`: read back every hit before using it (ReplayOptionError unless the pools
        hold float32 or float64, which the default model configs do). `tiers`: a host tier (and
        storage) over `system`, of any family (`kvstrata.build.build_tiers`): hits then come
        from every tier, and full-page evictions go through its write policy."""
        if tiers is not None and tiers.system is not system:
            raise ReplayOptionError("the tiers were built over another memory system")
        self.system = system
        self.tiers = tiers
        # The one object the replay drives, whatever tiers exist (unified_radix_cache.protocol).
        self.cache: PrefixCache = (tiers or system).cache
        self.forward = StandInForward(system)
        if verify:
            self.forward.check_exact()
        self.verify = verify
        self._page_size = system.page_size
        self._has_mamba = bool(system.mamba_layer_ids)
        self.reset_counters()

    # ------------------------------------------------------------------------------------------
    # Counters
    # ------------------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero every counter (the tree and the pools are left as they are)."""
        self.counters = ReplayCounters()
        counters = self.cache.transfer_counters()
        self._tier_base: TierCounters | None = None if counters is None else replace(counters)

    def stats(self) -> ReplayStats:
        """A snapshot of the counters. O(1); mutates nothing."""
        c = self.counters
        return ReplayStats(
            requests=c.requests,
            prompt_tokens=c.prompt_tokens,
            hit_tokens=c.hit_tokens,
            computed_tokens=c.computed_tokens,
            evicted_tokens=c.evicted_tokens,
            cache_seconds=c.cache_seconds,
            kv_write_seconds=c.kv_write_seconds,
            tiers=self._tier_stats(),
        )

    def _tier_stats(self) -> TierStats | None:
        now, base = self.cache.transfer_counters(), self._tier_base
        if now is None or base is None:
            return None
        c = self.counters
        return TierStats(
            device_hit_tokens=c.device_hit_tokens,
            host_hit_tokens=c.host_hit_tokens,
            storage_hit_tokens=c.storage_hit_tokens,
            bytes_d2h=now.bytes_d2h - base.bytes_d2h,
            bytes_h2d=now.bytes_h2d - base.bytes_h2d,
            bytes_storage_get=now.bytes_storage_get - base.bytes_storage_get,
            bytes_storage_set=now.bytes_storage_set - base.bytes_storage_set,
            transfer_wait_seconds=now.transfer_wait_seconds - base.transfer_wait_seconds,
            failed_transfers=now.failed_ops - base.failed_ops,
        )

    # ------------------------------------------------------------------------------------------
    # Driving requests
    # ------------------------------------------------------------------------------------------
    def check_fits(self, requests: Sequence[ReplayRequest]) -> None:
        """Raise CapacityTooSmall if some request could not run even with the tree empty: its
        page-rounded length exceeds the full pool or the SWA pool. (A Mamba pool always has
        room: the builder refuses fewer than two state slots.) Mutates nothing."""
        system = self.system
        capacity = system.capacity_tokens
        swa = system.swa_allocator
        if swa is not None:
            capacity = min(capacity, swa.swa_size)
        page = self._page_size
        for index, request in enumerate(requests):
            need = -(-request.num_tokens // page) * page
            if need > capacity:
                raise CapacityTooSmall(
                    capacity_tokens=capacity, needed_tokens=need, request_index=index
                )

    def run(
        self,
        requests: Sequence[ReplayRequest],
        *,
        on_progress: ProgressCallback | None = None,
        progress_every: int = 64,
    ) -> ReplayStats:
        """Replay `requests` in order; return the counters afterwards.

        Checks the capacity first (CapacityTooSmall before any request runs). Mutates the tree,
        the allocators, the pools and the counters. `on_progress(done)` is called every
        `progress_every` requests and once at the end.
        """
        if progress_every < 1:
            raise ReplayOptionError(f"progress_every must be >= 1, got {progress_every}")
        self.check_fits(requests)
        for done, request in enumerate(requests, start=1):
            self.step(request)
            if on_progress is not None and done % progress_every == 0:
                on_progress(done)
        if on_progress is not None:
            on_progress(len(requests))
        return self.stats()

    def step(self, request: ReplayRequest) -> StepResult:
        """Match, lock, allocate, write, insert and unlock one request (see the module doc).

        Leaves nothing locked and no slot outside the tree or the allocators. Raises
        CapacityTooSmall if eviction cannot make room (only possible when `check_fits` was
        skipped), after aborting the request: its lock and slots are given back, the tree keeps
        what it had minus what was evicted. With `verify`, raises KVMismatch when a hit reads
        back other KV than was written for its tokens.
        """
        cache = self.cache
        counters = self.counters
        page = self._page_size
        tokens = request.token_ids
        n = int(tokens.size)
        stored = n - n % page  # the tree keeps whole pages only
        usable = (n - 1) // page * page  # the longest hit a repeat of this prompt may use
        evicted_before = cache.evicted_tokens

        start = time.perf_counter()
        req = cache.begin_request(RadixKey(tokens))
        counters.device_hit_tokens += req.hit.device_len
        counters.host_hit_tokens += req.hit.host_len
        counters.storage_hit_tokens += req.hit.storage_len
        hit = req.cached_len  # <= usable <= stored
        new = n - hit
        need = -(-new // page) * page
        if self.system.kv_allocator.available_size() < need:
            counters.evict_calls += 1  # the allocation below evicts first
        kv = cache.alloc_tokens(need)
        if kv is None:
            cache.abort_request(req)
            raise self._too_small(self.system.capacity_tokens, need)
        if self._has_mamba and req.state_slot is None:
            self._count_state_eviction()
            req.state_slot = cache.alloc_state()
            if req.state_slot is None:
                cache.release(kv)
                cache.abort_request(req)
                mamba = self.system.mamba_allocator
                raise self._too_small(0 if mamba is None else mamba.size, 1)
        start = self._lap(start, forward=False)

        if self.verify:
            # Every loaded layer has arrived (the stand-in forward reads them all at once).
            load = req.hit.load
            if load is not None:
                for layer_id in self.system.attention_layer_ids:
                    load.wait_layer(layer_id)
            self.forward.verify_hit(
                tokens, hit, req.kv_indices, req.state_slot, request_index=counters.requests
            )
        self.forward.write_kv(tokens, hit, kv[:new])
        start = self._lap(start, forward=True)

        # The tree keeps whole pages: the last partial page (and the padding after it) is given
        # back now; the rest is handed over below.
        tail = kv[stored - hit :]
        if tail.numel():
            cache.release(tail)
        if req.state_slot is not None and hit < usable < stored:
            # A prompt of whole pages: its repeat may reuse only `usable` = n - page tokens, and
            # a Mamba match must end where a state was cached. So the prefill runs as two chunks
            # and the cache keeps a copy of the state at the chunk boundary as well (its write
            # policy sees the chunk too, so that state can reach the host).
            start = self._lap(start, forward=False)
            self.forward.write_state(tokens, usable, req.state_slot)
            start = self._lap(start, forward=True)
            req.extend(kv[: usable - hit])
            self._count_state_eviction()
            cache.cache_unfinished_request(req)
            start = self._lap(start, forward=False)
            self.forward.write_state(tokens, stored, req.state_slot)
            start = self._lap(start, forward=True)
            req.extend(kv[usable - hit : stored - hit])
        else:
            if req.state_slot is not None:
                # Checkpointed at the last page boundary, where the node holding it will end.
                start = self._lap(start, forward=False)
                self.forward.write_state(tokens, stored, req.state_slot)
                start = self._lap(start, forward=True)
            req.extend(kv[: stored - hit])
        cache.cache_finished_request(req)
        self._lap(start, forward=False)

        evicted = cache.evicted_tokens - evicted_before
        counters.requests += 1
        counters.prompt_tokens += n
        counters.hit_tokens += hit
        counters.computed_tokens += new
        counters.evicted_tokens += evicted
        return StepResult(
            prompt_tokens=n, hit_tokens=hit, computed_tokens=new, evicted_tokens=evicted
        )

    def _count_state_eviction(self) -> None:
        """Count the eviction the cache makes when the Mamba state pool is out."""
        mamba = self.system.mamba_allocator
        if mamba is not None and mamba.available_size() < 1:
            self.counters.evict_calls += 1

    def _too_small(self, capacity: int, needed: int) -> CapacityTooSmall:
        return CapacityTooSmall(
            capacity_tokens=capacity, needed_tokens=needed, request_index=self.counters.requests
        )

    def _lap(self, start: float, *, forward: bool) -> float:
        """Charge the time since `start` to the forward (KV writes) or to the cache; return now."""
        now = time.perf_counter()
        if forward:
            self.counters.kv_write_seconds += now - start
        else:
            self.counters.cache_seconds += now - start
        return now
