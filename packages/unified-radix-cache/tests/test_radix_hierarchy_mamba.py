"""Hierarchical mode for attention + Mamba models: host token slots and host state slots on the
nodes of one Full + Mamba tree; writes carry the node's state, load-backs bring the boundary
state back into a fresh device slot, a host hit ends only where a state is restorable, and
faults (no host or device state slot) leave a shorter hit, never a wrong one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata.testkit.tiers import (
    Hierarchy,
    assert_prefix_kv,
    assert_prefix_state,
    extra_host_copy,
    scramble_free_device,
    serve,
    write_prefix_kv,
    write_prefix_state,
)
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    MambaComponent,
    RadixKey,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 4


def test_write_through_carries_the_state_to_the_host(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, node = served("mamba", 3)
    assert node.host_value is not None and extra_host_copy(node) is not None
    mamba = h.tree.component("mamba")
    assert isinstance(mamba, MambaComponent) and mamba.slot(node) is not None
    assert h.cache.device_tree.component("mamba").host_held_size == 1
    states = h.cache.component_hosts["mamba"]
    assert states.available_size() == states.size - 1


def test_round_trips_are_bit_identical_through_write_evict_load(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy("mamba", device_pages=12)
    a = list(range(1, 3 * P + 1))
    b = [*a, *range(50, 50 + 2 * P)]
    assert serve(h, [*a, 99, 98, 97, 96]) == 0
    # b shares a's first 3 pages, but the state there is not cached (it ends inside a node).
    assert serve(h, b) == 0
    for cycle in range(4):
        h.cache.evict_device(h.tree.evictable_size())
        assert h.tree.evictable_size() == 0 and h.tree.evictable_size("mamba") == 0
        h.cache.check_integrity()
        scramble_free_device(h, seed=cycle)
        # The whole of b comes back from the host (pages + the state at its end).
        hit = serve(h, [*b, 7, 7, 7, 7])
        assert hit == len(b)
        assert h.cache.counters.loaded_tokens > 0
    assert h.cache.counters.host_hit_tokens >= 4 * len(b)


def test_host_hit_ends_only_where_a_state_is_restorable(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = offloaded("mamba", 4)
    # A query ending inside a's node: the split head has pages on the host but no state.
    m = h.cache.match_prefix(RadixKey(a[: 3 * P]))
    assert m.device.prefix_len == 0 and m.host_hit_len == 0
    m = h.cache.match_prefix(RadixKey([*a, 1, 2, 3, 4]))
    assert m.device.prefix_len == 0 and m.host_hit_len == 4 * P
    assert m.host_node is not None and extra_host_copy(m.host_node) is not None
    h.cache.check_integrity()


def test_a_tombstoned_device_state_is_loaded_alone(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = served("mamba", 3)
    moved = h.cache.counters.loaded_tokens
    # Mamba eviction drops the device state; the pages stay on the device (a leaf with a host
    # copy is kept, not removed).
    h.tree.evict(EvictRequest(targets={"mamba": 1}))
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.on_device and extra_host_copy(node) is not None
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.device.prefix_len == 0 and m.host_hit_len == len(a)
    scramble_free_device(h, seed=3)
    assert serve(h, [*a, 5, 5, 5, 5]) == len(a)
    assert h.cache.counters.loaded_tokens == moved  # no page moved, only the state


def test_no_device_state_slot_refuses_the_load(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = offloaded("mamba", 3)
    hoard = h.states.alloc(h.states.available_size())
    assert hoard is not None
    m = h.cache.match_prefix(RadixKey([*a, 5, 5, 5, 5]))
    assert m.host_hit_len == len(a) and m.host_node is not None
    result = h.cache.load_back(m.host_node)
    assert result.loaded_len == 0 and h.cache.counters.load_backs_refused == 1
    h.cache.check_integrity({"mamba": len(hoard)})
    h.states.free(hoard)
    scramble_free_device(h, seed=5)
    assert serve(h, [*a, 5, 5, 5, 5]) == len(a)


def test_host_eviction_frees_host_state_slots(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, _ = served("mamba", 3)
    serve(h, list(range(100, 100 + 2 * P)))
    assert h.cache.device_tree.component("mamba").host_held_size == 2
    h.cache.evict_device(h.tree.evictable_size())
    h.cache.evict_host(10**6)
    assert h.cache.device_tree.component("mamba").host_held_size == 0 and h.tree.num_nodes == 0
    assert h.cache.device_tree.component("mamba").host_evicted_total == 2
    allocator = h.cache.component_hosts["mamba"]
    assert allocator.available_size() == allocator.size
    h.cache.check_integrity()


def test_refusals(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy("mamba")
    tiers = h.tiers
    with pytest.raises(InvalidConfig, match="component_hosts"):
        states = h.states.__class__(size=4, device="cpu")
        tree = UnifiedRadixCache(
            [
                FullComponent(h.allocator.__class__(size=64, page_size=P, device="cpu")),
                MambaComponent(states, h.mamba_pool),
            ],
            page_size=P,
        )
        HierarchicalCache(
            tree, controller=h.cache.controller, host_allocator=tiers.hosts["full"].make_allocator()
        )

    assert TierParams().write_policy is WritePolicy.WRITE_THROUGH


def test_layer_wise_load_brings_pages_and_state(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, node = offloaded("mamba", 3)
    assert not node.on_device
    load = h.cache.start_load_back(node)
    assert not load.done or load.result is not None
    for layer in h.tiers.pools.layer_ids:  # attention and Mamba layers, in model order
        assert load.wait_layer(layer, 10.0)
    back = load.wait(10.0)
    assert back is not None and back.loaded_len == len(a)
    mamba = h.tree.component("mamba")
    assert isinstance(mamba, MambaComponent)
    state = mamba.slot(node)
    assert node.on_device and state is not None
    ids = torch.tensor(a, dtype=torch.int64)
    assert_prefix_kv(h.device_pool, h.cache.keyer, ids, back.match.device_indices, what="load")
    assert_prefix_state(
        h.mamba_pool, h.cache.keyer, ids, torch.tensor([state]), what="the tree's state"
    )
    h.cache.check_integrity()


def test_a_failed_load_frees_the_state_slot_too(
    offloaded: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, _, node = offloaded("mamba", 2)
    free_kv, free_states = h.allocator.available_size(), h.states.available_size()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("copy engine fault")

    h.cache.controller.group.load_pages = broken  # type: ignore[method-assign]
    back = h.cache.load_back(node)
    assert back.loaded_len == 0 and back.match.prefix_len == 0
    assert not node.on_device and extra_host_copy(node) is not None
    assert h.allocator.available_size() == free_kv
    assert h.states.available_size() == free_states
    assert h.cache.counters.failed_ops == 1
    h.cache.check_integrity()


def test_a_failed_write_leaves_no_host_state(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy("mamba")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("copy engine fault")

    h.cache.controller.group.backup_pages = broken  # the tiers write page ids
    a = list(range(1, 2 * P + 1))
    serve(h, a)
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.host_value is None and extra_host_copy(node) is None
    allocator = h.cache.component_hosts["mamba"]
    assert allocator.available_size() == allocator.size
    assert h.cache.counters.failed_ops >= 1


def test_the_device_tree_api_copies_the_state_on_a_tiered_tree(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> None:
    h, a, _ = served("mamba", 2)
    ids = torch.tensor([*a, 3, 3, 3, 3], dtype=torch.int64)
    req = h.tree.begin_request(RadixKey(ids))
    assert req.cached_len == len(a) and req.state_slot is not None
    assert_prefix_state(h.mamba_pool, h.cache.keyer, ids[: len(a)], req.state_slot, what="cow")
    node = node_at(h.tree, RadixKey(a))
    mamba = h.tree.component("mamba")
    assert node is not None and isinstance(mamba, MambaComponent)
    assert int(req.state_slot) != mamba.slot(node), "the request owns a copy, not the tree's"
    h.cache.check_integrity(req.held())
    h.tree.abort_request(req)
    h.cache.check_integrity()


def test_insert_with_a_state_and_the_host_state_gauge(hierarchy: Callable[..., Hierarchy]) -> None:
    from prometheus_client import CollectorRegistry

    from kvstrata.unified_radix_cache import MambaInsert
    from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector

    h = hierarchy("mamba")
    ids = torch.tensor(range(1, 2 * P + 1), dtype=torch.int64)
    slots = h.allocator.alloc(len(ids))
    state = h.states.alloc(1)
    assert slots is not None and state is not None
    write_prefix_kv(h.device_pool, h.cache.keyer, ids, slots, 0)
    write_prefix_state(h.mamba_pool, h.cache.keyer, ids, state)
    result = h.cache.insert(RadixKey(ids), slots, inputs={"mamba": MambaInsert(slot=int(state))})
    assert result.adopted_states == ("mamba",)
    h.cache.drain()
    registry = CollectorRegistry()
    registry.register(TierCacheCollector(h.cache, labels={"instance": "m"}))
    held = registry.get_sample_value(
        "kvstrata_tiered_cache_host_states", {"instance": "m", "state": "held"}
    )
    assert held == 1
    h.cache.evict_device(h.tree.evictable_size())
    scramble_free_device(h, seed=11)
    assert serve(h, [*ids.tolist(), 4, 4, 4, 4]) == len(ids)
