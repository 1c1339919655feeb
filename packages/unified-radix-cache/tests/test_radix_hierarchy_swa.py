"""Hierarchical mode for full + sliding-window models: host copies of each node's full pages and
of the SWA pages of the window before each write's end on the nodes of one Full + SWA tree; a
host hit counts only as far as the last window before it is restorable; a load-back brings the
full pages and the window's SWA pages (SWA slots allocated in step); evictions free the right
slots on both pools of both tiers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstrata.allocator import SWAAllocator
from kvstrata.testkit.tiers import (
    Hierarchy,
    extra_host_copy,
    scramble_free_device,
    serve,
)
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    RadixKey,
    SWAComponent,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.errors import IntegrityError, InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.node import TreeNode

P = 4


def _host_swa(h: Hierarchy) -> int:
    allocator = h.cache.component_hosts["swa"]
    return allocator.size - allocator.available_size()


def test_a_write_copies_only_the_window_of_swa_pages(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, node = served("swa", 5)
    assert extra_host_copy(node) is not None
    # The write split the node at the window: the head has full pages on the host only.
    assert node.num_tokens == h.window
    assert node.parent is not None and node.parent.host_value is not None
    assert extra_host_copy(node.parent) is None
    assert _host_swa(h) == h.window == h.cache.device_tree.component("swa").host_held_size
    group = h.cache.controller.group
    pages = 5 * group.page_bytes("full") + 2 * group.page_bytes("swa")
    assert h.cache.counters.bytes_d2h == pages


def test_round_trips_are_bit_identical(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy("swa", device_pages=12)
    a = list(range(1, 4 * P + 1))
    b = [*a, *range(50, 50 + 3 * P)]
    assert serve(h, a) == 0
    assert serve(h, b) == len(a)
    for cycle in range(4):
        h.cache.evict_device(h.tree.evictable_size())
        assert h.tree.evictable_size() == 0 and h.tree.evictable_size("swa") == 0
        h.cache.check_integrity()
        scramble_free_device(h, seed=cycle)
        # All of b comes back: its full pages, and the SWA pages of its last window.
        assert serve(h, [*b, 7, 7, 7, 7]) == len(b)
        h.cache.evict_device(h.tree.evictable_size())
        scramble_free_device(h, seed=10 + cycle)
        # a's end has its own host window (written when a was served).
        assert serve(h, [*a, 9, 9, 9, 9]) == len(a)
    assert h.cache.counters.loaded_tokens > 0
    h.cache.check_integrity()


def test_host_hit_ends_where_a_window_is_restorable(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = offloaded("swa", 6)
    # Inside a, 4 pages in: the window before it was never copied to the host.
    m = h.cache.match_prefix(RadixKey([*a[: 4 * P], 5, 5, 5, 5]))
    assert m.device.prefix_len == 0 and m.host_hit_len == 0
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.device.prefix_len == 0 and m.host_hit_len == len(a)
    h.cache.check_integrity()


def test_a_device_swa_tombstone_is_not_restored_from_the_host(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = served("swa", 4)
    # SWA eviction tombstones the window node: full pages stay on the device, SWA slots go.
    h.tree.evict(EvictRequest(targets={"swa": 10**6}))
    assert h.tree.evictable_size("swa") == 0
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.prefix_len == 0  # (the allocator cannot give existing full slots new SWA slots)
    assert serve(h, [*a, 5, 5, 5, 5]) == 0
    h.cache.check_integrity()


def test_evictions_free_both_pools_on_both_tiers(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, _ = served("swa", 3)
    serve(h, list(range(100, 100 + 4 * P)))
    assert _host_swa(h) == 2 * h.window
    h.cache.evict_device(h.tree.evictable_size())
    assert h.allocator.full_available_size() == h.allocator.full_size
    assert h.allocator.swa_available_size() == h.allocator.swa_size
    h.cache.evict_host(10**6)
    assert h.tree.num_nodes == 0 and _host_swa(h) == 0
    assert h.cache.device_tree.component("swa").host_evicted_total == 2 * h.window
    h.cache.check_integrity()


def test_layer_wise_load_brings_full_and_swa_layers(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = offloaded("swa", 3)
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.host_hit_len == len(a)
    load = h.cache.start_load_back(m.host_node)
    for layer in h.tiers.pools.layer_ids:
        assert load.wait_layer(layer, 10.0)
    h.cache.check_integrity()
    result = load.wait(10.0)
    assert result is not None and result.loaded_len == len(a)
    group = h.cache.controller.group
    assert h.cache.counters.bytes_h2d == 3 * group.page_bytes("full") + 2 * group.page_bytes("swa")
    h.cache.check_integrity()
    scramble_free_device(h, seed=2)
    assert serve(h, [*a, 5, 5, 5, 5]) == len(a)


def test_a_failed_load_frees_full_and_swa_slots(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, a, _ = offloaded("swa", 3)
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("host SWA pages unreadable")

    # The SWA member's host -> device copy raises on the worker: the load fails whole.
    with monkeypatch.context() as patch:
        patch.setattr(h.tiers.hosts["swa"], "load_layers", broken)
        patch.setattr(h.tiers.hosts["swa"], "load_layers_planned", broken)  # the tiers' path
        result = h.cache.load_back(m.host_node)
    assert result.loaded_len == 0 and h.cache.counters.failed_ops >= 1
    assert h.allocator.full_available_size() == h.allocator.full_size
    assert h.allocator.swa_available_size() == h.allocator.swa_size
    h.cache.check_integrity()
    assert serve(h, [*a, 5, 5, 5, 5]) == len(a)


def test_refusals(hierarchy: Callable[..., Hierarchy]) -> None:
    """An SWA tree needs the host SWA allocator (storage: test_radix_hierarchy_hybrid_storage)."""
    h = hierarchy("swa")
    tiers = h.tiers

    def tree() -> UnifiedRadixCache:
        alloc = SWAAllocator(size=64, swa_size=64, page_size=P, device="cpu")
        return UnifiedRadixCache(
            [FullComponent(alloc), SWAComponent(alloc, sliding_window=2 * P)], page_size=P
        )

    with pytest.raises(InvalidConfig, match="component_hosts"):
        HierarchicalCache(
            tree(),
            controller=h.cache.controller,
            host_allocator=tiers.hosts["full"].make_allocator(),
        )


def test_integrity_catches_a_leaked_host_swa_copy(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, node = served("swa", 3)
    assert extra_host_copy(node) is not None
    value = extra_host_copy(node)
    assert node.comp_hosts is not None
    node.comp_hosts[1] = None  # the slots stay allocated, no node holds them
    with pytest.raises(IntegrityError, match="host swa"):
        h.cache.check_integrity()
    node.comp_hosts[1] = value
    h.cache.check_integrity()


def test_collector_reports_host_swa_slots(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    from prometheus_client import CollectorRegistry

    from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector

    h, _, _ = served("swa", 3)
    registry = CollectorRegistry()
    registry.register(TierCacheCollector(h.cache, labels={"instance": "s"}))
    labels = {"instance": "s"}
    held = registry.get_sample_value(
        "kvstrata_tiered_cache_host_swa_tokens", {**labels, "state": "held"}
    )
    assert held == h.window
    free = registry.get_sample_value(
        "kvstrata_tiered_cache_host_swa_tokens", {**labels, "state": "free"}
    )
    allocator = h.cache.component_hosts["swa"]
    assert free == allocator.size - h.window
