"""Hypothesis state machine over both tiers and storage: requests (match on every tier, prefetch,
load back, compute, insert under the write policy), layer-wise load-backs left in flight, device
and host evictions, acks; after every step `check_integrity()` of both tiers, and every hit's KV
is checked bit for bit against what the stand-in forward computes for that prefix."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import Hierarchy, assert_prefix_kv, make_hierarchy, write_prefix_kv
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 2
PREFIXES = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10, 11, 12], [])


class TwoTierMachine(RuleBasedStateMachine):
    h: Hierarchy | None = None

    @initialize(
        policy=st.sampled_from(list(WritePolicy)),
        prefetch=st.sampled_from([PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.BEST_EFFORT]),
        storage=st.booleans(),
    )
    def build(self, policy: WritePolicy, prefetch: PrefetchPolicy, storage: bool) -> None:
        params = TierParams(write_policy=policy, prefetch_policy=prefetch, prefetch_threshold=P)
        self.h = make_hierarchy(
            page_size=P,
            device_pages=12,
            host_pages=16,
            storage=MemoryStorage(capacity_bytes=1 << 22) if storage else None,
            params=params,
        )
        self.served = 0

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
        assert_prefix_kv(h.device_pool, cache.keyer, tokens, req.kv_indices[:hit], what="hit")
        need = len(tokens) - hit
        if need > h.allocator.available_size():
            cache.evict_device(need - h.allocator.available_size())
        slots = h.allocator.alloc(need)
        if slots is None:
            h.tree.abort_request(req)
            return
        full = torch.cat([req.kv_indices, slots])
        write_prefix_kv(h.device_pool, cache.keyer, tokens, full, hit)
        req.extend(slots)
        cache.cache_finished_request(req)
        self.served += 1

    @precondition(lambda self: self.h is not None)
    @rule(prefix=st.sampled_from(PREFIXES[:3]), first_layer=st.booleans())
    def start_load(self, prefix: list[int], first_layer: bool) -> None:
        """A layer-wise load-back left in flight (committed by a later poll, drain or match)."""
        h = self.h
        assert h is not None
        m = h.cache.match_prefix(RadixKey(torch.tensor(prefix, dtype=torch.int64)))
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
    @rule(amount=st.integers(1, 24))
    def evict_host(self, amount: int) -> None:
        assert self.h is not None
        self.h.cache.evict_host(amount)

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


TestTwoTiers = TwoTierMachine.TestCase
