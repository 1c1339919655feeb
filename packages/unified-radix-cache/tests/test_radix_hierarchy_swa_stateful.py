"""Hypothesis state machine over the tiers of a Full + SWA tree, with or without storage:
requests (match on every tier, prefetch full pages and a window's SWA pages from storage under
the prefetch policy, load back full pages and the window's SWA pages, compute, insert under the
write policy; with storage, backups of full pages and host SWA pages), storage faults (corrupt
or failing SWA and full pages),
layer-wise load-backs left in flight, device eviction of full pages and of SWA windows
(tombstones), host eviction, acks; after every step `check_integrity()` of both tiers and of
the full and SWA pools on both tiers, and every hit's full KV and last-window SWA KV are checked
bit for bit against what the stand-in forward computes for that prefix."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage
from kvstrata.testkit.tiers import (
    SWAHierarchy,
    assert_prefix_kv,
    assert_window_kv,
    make_swa_hierarchy,
    scramble,
    write_prefix_kv,
)
from kvstrata.unified_radix_cache import EvictRequest, RadixKey
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 2
PREFIXES = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 13, 14, 15, 16], [])


class SWATwoTierMachine(RuleBasedStateMachine):
    h: SWAHierarchy | None = None
    storage: FaultInjectingStorage | None = None

    @initialize(
        policy=st.sampled_from(list(WritePolicy)),
        host_pages=st.sampled_from([8, 16]),
        prefetch=st.sampled_from([None, *PrefetchPolicy]),
    )
    def build(self, policy: WritePolicy, host_pages: int, prefetch: PrefetchPolicy | None) -> None:
        """`prefetch` None: no storage; else a (fault-injecting) storage tier prefetched under
        that policy."""
        if prefetch is not None:
            self.storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 22))
        self.h = make_swa_hierarchy(
            page_size=P,
            device_pages=12,
            host_pages=host_pages,
            storage=self.storage,
            params=TierParams(
                write_policy=policy,
                prefetch_threshold=P,
                prefetch_policy=prefetch or PrefetchPolicy.BEST_EFFORT,
            ),
        )

    def teardown(self) -> None:
        if self.h is not None:
            self.h.cache.controller.close()

    @precondition(lambda self: self.h is not None)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(20, 23), min_size=1, max_size=3).map(lambda s: s * P),
    )
    def request(self, prefix: list[int], suffix: list[int]) -> None:
        h = self.h
        assert h is not None
        cache = h.cache
        tokens = torch.tensor(prefix + suffix, dtype=torch.int64)
        req = cache.begin_request(RadixKey(tokens))
        hit = req.cached_len
        assert hit == req.hit.total_len
        assert_prefix_kv(h.full_pool, cache.keyer, tokens, req.kv_indices[:hit], what="hit")
        lo = max(hit - h.window, 0)
        window = h.allocator.translate(req.kv_indices[lo:hit])
        assert bool((window > 0).all()), "a hit keeps its last window's SWA slots"
        assert_window_kv(h.swa_pool, cache.keyer, tokens[:hit], window, lo, what="hit SWA")
        need = len(tokens) - hit
        if need > h.allocator.available_size():
            cache.evict_device(need - h.allocator.available_size())
        slots = h.allocator.alloc(need)
        if slots is None:
            h.tree.abort_request(req)
            return
        full = torch.cat([req.kv_indices, slots])
        write_prefix_kv(h.full_pool, cache.keyer, tokens, full, hit)
        write_prefix_kv(h.swa_pool, cache.keyer, tokens, h.allocator.translate(full), hit)
        req.extend(slots)
        cache.cache_finished_request(req)

    @precondition(lambda self: self.h is not None)
    @rule(prefix=st.sampled_from(PREFIXES[:4]), first_layer=st.booleans())
    def start_load(self, prefix: list[int], first_layer: bool) -> None:
        """A layer-wise load-back left in flight (committed by a later poll, drain or match)."""
        h = self.h
        assert h is not None
        m = h.cache.match_prefix(RadixKey(torch.tensor([*prefix, 20, 20], dtype=torch.int64)))
        if not m.host_hit_len:
            return
        load = h.cache.start_load_back(m.host_node)
        if first_layer and not load.done:
            assert load.wait_layer(h.tiers.pools.layer_ids[0], 10.0)

    @precondition(lambda self: self.h is not None)
    @rule(amount=st.integers(1, 16))
    def evict_device(self, amount: int) -> None:
        assert self.h is not None
        self.h.cache.evict_device(amount)

    @precondition(lambda self: self.h is not None)
    @rule(amount=st.integers(1, 8))
    def evict_windows(self, amount: int) -> None:
        assert self.h is not None
        self.h.tree.evict(EvictRequest(targets={"swa": amount}))

    @precondition(lambda self: self.h is not None)
    @rule(amount=st.integers(1, 24))
    def evict_host(self, amount: int) -> None:
        assert self.h is not None
        self.h.cache.evict_host(amount)

    @precondition(lambda self: self.h is not None)
    @rule(seed=st.integers(0, 3))
    def evict_all(self, seed: int) -> None:
        """Evict every device and host copy that may go and scramble the free device pages:
        what comes back next must come from the host or storage."""
        h = self.h
        assert h is not None
        h.cache.evict_device(h.tree.evictable_size())
        h.cache.drain()
        h.cache.evict_host(10**6)
        taken = h.allocator.alloc(h.allocator.available_size())
        if taken is not None and len(taken):
            scramble(h.full_pool, taken, seed=seed)
            scramble(h.swa_pool, h.allocator.translate(taken), seed=seed + 1)
            h.allocator.free(taken)

    @precondition(lambda self: self.storage is not None)
    @rule(
        prefix=st.sampled_from(PREFIXES[:4]),
        member=st.sampled_from(["swa", "full", None]),
        fail=st.booleans(),
    )
    def storage_faults(self, prefix: list[int], member: str | None, fail: bool) -> None:
        """From now on the pages of `member` for `prefix` fail (or come back corrupt); None
        heals the storage."""
        h, storage = self.h, self.storage
        assert h is not None and storage is not None
        if member is None:
            storage.set_rules(FaultRules())
            return
        group = h.cache.controller.group
        keys = h.cache.keyer.page_keys(torch.tensor(prefix, dtype=torch.int64))
        bad = frozenset(group.storage_key(member, k) for k in keys)
        storage.set_rules(FaultRules(fail_keys=bad) if fail else FaultRules(corrupt_keys=bad))

    @precondition(lambda self: self.h is not None)
    @rule()
    def drain(self) -> None:
        assert self.h is not None
        self.h.cache.drain()

    @precondition(lambda self: self.h is not None)
    @invariant()
    def integrity(self) -> None:
        assert self.h is not None
        self.h.cache.check_integrity()


TestSWATwoTiers = SWATwoTierMachine.TestCase
