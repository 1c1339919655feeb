"""Hypothesis state machine over the tiers of a Full + Mamba tree, with or without storage:
requests (match on both tiers, load back pages and boundary state, compute, insert under the
write policy; with storage, backups of pages and boundary states and prefetches of the deepest
stored state), layer-wise load-backs left in flight, device eviction of pages and of states,
host eviction, acks; after every step `check_integrity()` of both tiers and both host pools,
and every hit's KV and state are checked bit for bit against what the stand-in forward computes
for that prefix."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import (
    MambaHierarchy,
    assert_prefix_kv,
    assert_prefix_state,
    make_mamba_hierarchy,
    write_prefix_kv,
    write_prefix_state,
)
from kvstrata.unified_radix_cache import EvictRequest, RadixKey
from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy


def _host_copy(node: TreeNode) -> ComponentValue:
    """The host copy on `node` of the tree's one component besides Full (index 1)."""
    return None if node.comp_hosts is None else node.comp_hosts[1]


P = 2
PREFIXES = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10, 11, 12], [])


class MambaTwoTierMachine(RuleBasedStateMachine):
    h: MambaHierarchy | None = None

    @initialize(
        policy=st.sampled_from(list(WritePolicy)),
        host_pages=st.sampled_from([8, 16]),
        prefetch=st.sampled_from([None, *PrefetchPolicy]),
    )
    def build(self, policy: WritePolicy, host_pages: int, prefetch: PrefetchPolicy | None) -> None:
        """`prefetch` None: no storage; else a storage tier prefetched under that policy."""
        self.h = make_mamba_hierarchy(
            page_size=P,
            device_pages=12,
            host_pages=host_pages,
            storage=None if prefetch is None else MemoryStorage(capacity_bytes=1 << 22),
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
        assert_prefix_kv(h.device_pool, cache.keyer, tokens, req.kv_indices[:hit], what="hit")
        if hit:
            assert req.state_slot is not None
            assert_prefix_state(h.mamba_pool, cache.keyer, tokens[:hit], req.state_slot, what="hit")
        else:
            req.state_slot = h.states.alloc(1)
            if req.state_slot is None:
                h.tree.evict(EvictRequest(targets={"mamba": 1}))
                req.state_slot = h.states.alloc(1)
        need = len(tokens) - hit
        if need > h.allocator.available_size():
            cache.evict_device(need - h.allocator.available_size())
        slots = h.allocator.alloc(need)
        if slots is None or req.state_slot is None:
            h.tree.abort_request(req)
            return
        write_prefix_kv(h.device_pool, cache.keyer, tokens, torch.cat([req.kv_indices, slots]), hit)
        write_prefix_state(h.mamba_pool, cache.keyer, tokens, req.state_slot)
        req.extend(slots)
        cache.cache_finished_request(req)

    @precondition(lambda self: self.h is not None)
    @rule(prefix=st.sampled_from(PREFIXES[:3]), first_layer=st.booleans())
    def start_load(self, prefix: list[int], first_layer: bool) -> None:
        """A layer-wise load-back left in flight (committed by a later poll, drain or match)."""
        h = self.h
        assert h is not None
        m = h.cache.match_prefix(RadixKey(torch.tensor([*prefix, 20, 20], dtype=torch.int64)))
        if not m.host_hit_len:
            return
        assert m.host_node is not None and _host_copy(m.host_node) is not None
        load = h.cache.start_load_back(m.host_node)
        if first_layer and not load.done:
            assert load.wait_layer(h.tiers.pools.layer_ids[0], 10.0)

    @precondition(lambda self: self.h is not None)
    @rule(amount=st.integers(1, 16))
    def evict_device(self, amount: int) -> None:
        assert self.h is not None
        self.h.cache.evict_device(amount)

    @precondition(lambda self: self.h is not None)
    @rule(amount=st.integers(1, 4))
    def evict_states(self, amount: int) -> None:
        assert self.h is not None
        self.h.tree.evict(EvictRequest(targets={"mamba": amount}))

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


TestMambaTwoTiers = MambaTwoTierMachine.TestCase
