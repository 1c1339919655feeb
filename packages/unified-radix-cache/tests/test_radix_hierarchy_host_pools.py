"""Host eviction for a component pool (host SWA slots, host Mamba state slots) evicts only host
copies that hold slots of that pool, and only when together they hold enough.

The scenes: page size 4, window 8 tokens (SWA). A 16-token prefix written through to the host
is two 8-token nodes; the host SWA copy exists only for the second (the window before the
write's end), the host state only at the end of the written key. A "non-holder" candidate is
the first node of a prefix whose second node was host-evicted: off the device, childless,
host-unlocked, with a host Full copy but no host SWA copy (no host state). The rest of the
component's host pool is hoarded by the test (a stand-in for copies held by nodes still on the
device or by transfers), so the allocation depends on what eviction can free; with nothing to
free, the pages go to the host without the component's copy and no host hit ends there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from kvstrata.pool_host import HostSlotAllocator
from kvstrata.testkit.tiers import Hierarchy, Shape, extra_host_copy, make_hierarchy, serve
from kvstrata.unified_radix_cache import HierarchicalCache, RadixKey, TreeNode
from kvstrata.unified_radix_cache.node import ComponentValue
from kvstrata.unified_radix_cache.paths import node_at

P = 4


def _tokens(base: int, n: int) -> list[int]:
    return [base + j for j in range(n)]


def _host_nodes(cache: HierarchicalCache) -> dict[int, TreeNode]:
    return {n.id: n for n in cache.device_tree.iter_nodes() if n.host_value is not None}


def _end_node(cache: HierarchicalCache, tokens: list[int]) -> TreeNode | None:
    """The node whose run ends exactly at the end of `tokens`, if any (read only: a match
    would stop at the host hit, which needs a restorable window or a host state)."""
    want = RadixKey(torch.tensor(tokens, dtype=torch.int64)).token_bytes()
    for node in cache.device_tree.iter_nodes():
        parts: list[bytes] = []
        probe = node
        while probe.parent is not None:
            parts.append(probe.key)
            probe = probe.parent
        if b"".join(reversed(parts)) == want:
            return node
    return None


def _swa_non_holder(h: Hierarchy, base: int) -> TreeNode:
    """Write a 16-token prefix through, push it off the device, host-evict its window node:
    its head stays as a host candidate without host SWA slots."""
    cache = h.cache
    serve(h, _tokens(base, 4 * P))
    cache.evict_device(cache.device_tree.evictable_size())
    assert cache.evict_host(2 * P) == 2 * P
    head = _end_node(cache, _tokens(base, 2 * P))
    assert head is not None and head in cache.tier.heap and extra_host_copy(head) is None
    return head


def _mamba_non_holder(h: Hierarchy, base: int) -> TreeNode:
    """Two prefixes sharing 8 tokens, off the device, both ends host-evicted: the shared head
    stays as a host candidate without a host state."""
    cache = h.cache
    first = _tokens(base, 4 * P)
    serve(h, first)
    serve(h, first[: 2 * P] + _tokens(base + 500, 2 * P))
    cache.evict_device(cache.device_tree.evictable_size())
    assert cache.evict_host(4 * P) == 4 * P
    head = _end_node(cache, first[: 2 * P])
    assert head is not None and head in cache.tier.heap and extra_host_copy(head) is None
    return head


class ComponentPool(NamedTuple):
    """What the scenes read of one component's host pool, per shape."""

    shape: Shape
    non_holder: Callable[[Hierarchy, int], TreeNode]
    host_value: Callable[[TreeNode], ComponentValue]
    allocator: Callable[[HierarchicalCache], HostSlotAllocator | None]
    #: The tier's count of what its eviction candidates hold of this pool.
    candidates: Callable[[HierarchicalCache], int]
    #: What one candidate holding this pool counts for.
    held_by: Callable[[TreeNode], int]
    #: Tokens host-evicted with the holder (its whole host run).
    holder_tokens: int

    def hoard(self, cache: HierarchicalCache) -> tuple[HostSlotAllocator, torch.Tensor]:
        """Take every free slot of this pool (the test frees them): the allocator and slots."""
        allocator = self.allocator(cache)
        assert allocator is not None
        held = allocator.alloc(allocator.available_size())
        assert held is not None
        return allocator, held


POOLS = [
    ComponentPool(
        "swa",
        _swa_non_holder,
        extra_host_copy,
        lambda cache: cache.component_hosts.get("swa"),
        lambda cache: cache.tier.candidate_size("swa"),
        lambda node: len(v) if (v := extra_host_copy(node)) is not None else 0,
        2 * P,
    ),
    ComponentPool(
        "mamba",
        _mamba_non_holder,
        extra_host_copy,
        lambda cache: cache.component_hosts.get("mamba"),
        lambda cache: cache.tier.candidate_size("mamba"),
        lambda node: 1,
        4 * P,
    ),
]


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.shape)
def test_failed_host_component_allocation_evicts_nothing(pool: ComponentPool) -> None:
    """The reviewer's R3 scene: the component's host slots are all taken by copies that cannot
    be evicted; a write wanting some must not host-evict copies that hold none."""
    h = make_hierarchy(pool.shape, page_size=P, device_pages=64, host_pages=64)
    cache = h.cache
    try:
        pool.non_holder(h, 1000)
        if pool.shape == "swa":
            serve(h, _tokens(9000, 4 * P))  # stays on the device: its host SWA copy is pinned
        assert pool.candidates(cache) == 0
        before = set(_host_nodes(cache))
        evicted = cache.counters.host_evicted_tokens
        hoard, held = pool.hoard(cache)
        serve(h, _tokens(7000, 3 * P), check=False)  # write_through wants component slots
        assert cache.counters.host_evicted_tokens == evicted, "evicted for a hopeless allocation"
        assert before <= set(_host_nodes(cache)), "a host copy went for nothing"
        written = _end_node(cache, _tokens(7000, 3 * P))
        assert written is not None and pool.host_value(written) is None, "the pages went alone"
        hoard.free(held)
        cache.check_integrity()
    finally:
        cache.controller.close()


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.shape)
def test_host_component_allocation_evicts_only_holders(pool: ComponentPool) -> None:
    """An older candidate without the component's host slots comes first in LRU order; the
    allocation skips it and evicts the newer candidate holding some, and succeeds."""
    h = make_hierarchy(pool.shape, page_size=P, device_pages=64, host_pages=64)
    cache = h.cache
    try:
        old = pool.non_holder(h, 1000)
        serve(h, _tokens(2000, 4 * P))
        cache.evict_device(cache.device_tree.evictable_size())
        holder = _end_node(cache, _tokens(2000, 4 * P))
        assert holder is not None and pool.host_value(holder) is not None
        assert holder in cache.tier.heap
        assert pool.candidates(cache) == pool.held_by(holder)
        cache.check_integrity()
        hoard, held = pool.hoard(cache)
        evicted = cache.counters.host_evicted_tokens
        serve(h, _tokens(7000, 3 * P), check=False)
        assert old.id in _host_nodes(cache), "a candidate without component slots was evicted"
        assert holder.id not in _host_nodes(cache)
        assert cache.counters.host_evicted_tokens == evicted + pool.holder_tokens
        written = _end_node(cache, _tokens(7000, 3 * P))
        assert written is not None and pool.host_value(written) is not None, "it went too"
        hoard.free(held)
        cache.check_integrity()
    finally:
        cache.controller.close()


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.shape)
def test_no_host_component_room_means_a_shorter_hit(
    pool: ComponentPool, hierarchy: Callable[..., Hierarchy]
) -> None:
    """The component's host pool is all taken: a write moves the pages without the
    component's copy, so no host hit ends there (never a wrong one), and the prefix is
    computed again, never restored without it."""
    h = hierarchy(pool.shape)
    hoard, held = pool.hoard(h.cache)
    a = _tokens(1, 3 * P)
    serve(h, a, check=False)  # pages go to the host, the component's copy cannot
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.host_value is not None and pool.host_value(node) is None
    h.cache.evict_device(h.tree.evictable_size())
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.prefix_len == 0 and m.device.prefix_len == 0 and m.host_hit_len == 0
    assert serve(h, [*a, 5, 5, 5, 5], check=False) == 0
    hoard.free(held)
    h.cache.check_integrity()


def test_candidate_counts_follow_a_split_and_a_lock() -> None:
    """A split of a candidate moves its head's host SWA slots out of the candidate count (the
    head has a child); a host lock takes a candidate out of it, the unlock puts it back."""
    h = make_hierarchy("swa", page_size=P, device_pages=64, host_pages=64)
    cache = h.cache
    tier = cache.tier
    try:
        serve(h, _tokens(1000, 4 * P))
        cache.evict_device(cache.device_tree.evictable_size())
        assert tier.candidate_size("swa") == 2 * P
        tail = _end_node(cache, _tokens(1000, 4 * P))
        assert tail is not None and extra_host_copy(tail) is not None and tail in tier.heap
        cache.device_tree.split_node(tail, P)  # the head (with its host SWA) is no candidate
        cache.check_integrity()
        assert tier.candidate_size("swa") == len(extra_host_copy(tail))
        receipt = tier.lock(tail)
        assert tier.candidate_size("swa") == 0 and tail not in tier.heap
        tier.unlock(receipt)
        assert tier.candidate_size("swa") == len(extra_host_copy(tail))
        cache.check_integrity()
    finally:
        cache.controller.close()
