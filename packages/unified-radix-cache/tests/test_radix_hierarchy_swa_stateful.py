"""Hypothesis state machine over both tiers of a Full + SWA tree: requests (match on both tiers,
load back full pages and the window's SWA pages, compute, insert under the write policy),
layer-wise load-backs left in flight, device eviction of full pages and of SWA windows
(tombstones), host eviction, acks; after every step `check_integrity()` of both tiers and of
the full and SWA pools on both tiers, and every hit's full KV and last-window SWA KV are checked
bit for bit against what the stand-in forward computes for that prefix."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.testkit.tiers import (
    SWAHierarchy,
    assert_prefix_kv,
    assert_window_kv,
    make_swa_hierarchy,
    write_prefix_kv,
)
from kvstrata.unified_radix_cache import EvictRequest, RadixKey
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 2
PREFIXES = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 13, 14, 15, 16], [])


class SWATwoTierMachine(RuleBasedStateMachine):
    h: SWAHierarchy | None = None

    @initialize(policy=st.sampled_from(list(WritePolicy)), host_pages=st.sampled_from([8, 16]))
    def build(self, policy: WritePolicy, host_pages: int) -> None:
        self.h = make_swa_hierarchy(
            page_size=P,
            device_pages=12,
            host_pages=host_pages,
            params=TierParams(write_policy=policy, prefetch_threshold=P),
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
        began = cache.begin_request(RadixKey(tokens))
        req = began.request
        hit = req.cached_len
        assert hit == began.device_hit_len + began.host_hit_len
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
