"""Issue 17: `evict` on a tree with a host tier checks the Full slots its device walk freed
before any reaches the allocator, and puts back every node the walk moved off the device when
one is refused (evict_undo.py): a free the allocator would refuse (the engine freed tree-held
slots behind the tree's back) raises with the tree and the allocator unchanged, whether the bad
slot sits in a whole leaf, in the tail of a leaf the walk splits, or in a parent the walk
reaches after its children; a bad slot the walk would not reach refuses nothing. (SWA and
Mamba refusals, storage, and the full before/after state: test_radix_hierarchy_evict_undo.py.)"""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import NotAllocated
from kvstrata.testkit.tiers import Hierarchy, Shape, make_hierarchy
from kvstrata.unified_radix_cache import EvictRequest, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.components.full import FullComponent

P = 4


def _snapshot(tree: UnifiedRadixCache) -> tuple[object, ...]:
    nodes = sorted(
        (n.id, n.key, n.value.tolist(), n.host_value is not None) for n in tree.iter_nodes()
    )
    return (tuple(nodes), tree.evictable_size(), tree.protected_size(), tree.num_nodes)


@pytest.mark.parametrize("shape", ["full", "swa"])
def test_hierarchical_evict_refused_by_the_allocator_changes_nothing(
    closing: list[Hierarchy], shape: Shape
) -> None:
    h = make_hierarchy(shape, page_size=P)
    closing.append(h)
    key = RadixKey(list(range(1, 3 * P + 1)))
    slots = h.allocator.alloc(3 * P)
    assert slots is not None
    h.cache.insert(key, slots)
    h.cache.drain()  # the leaf has a host copy: eviction keeps the node, off the device
    h.allocator.free(slots[-P:].clone())  # the engine frees the tree's last page
    before = _snapshot(h.tree)
    with pytest.raises(NotAllocated):
        h.tree.evict(EvictRequest.full(3 * P))
    assert _snapshot(h.tree) == before
    matched = h.tree.match_prefix(key)
    assert matched.prefix_len == 3 * P
    assert torch.equal(matched.device_indices, slots)


def _check_heap(tree: UnifiedRadixCache) -> None:
    """The device-leaf heap is whole and holds exactly the device leaves (`check_integrity`
    would also count the pool, which the engine's free behind the tree's back unbalanced)."""
    full = tree.components[0]
    assert isinstance(full, FullComponent)
    assert full.heap is not None
    full.heap.check_integrity()
    for node in tree.iter_nodes():
        if node.parent is not None:
            full.check_node(node)


def _two_level(h: Hierarchy) -> tuple[RadixKey, RadixKey, torch.Tensor, torch.Tensor]:
    """A parent of 2 pages with one child of 2 pages, both with host copies."""
    key = RadixKey(list(range(1, 4 * P + 1)))
    slots = h.allocator.alloc(4 * P)
    assert slots is not None
    h.cache.insert(key, slots)
    other = RadixKey([*range(1, 2 * P + 1), *range(500, 500 + 2 * P)])
    fresh = h.allocator.alloc(4 * P)
    assert fresh is not None
    h.cache.insert(other, fresh)
    h.allocator.free(fresh[: 2 * P].clone())  # the engine frees its copy of the shared prefix
    tail = fresh[2 * P :]
    h.cache.drain()
    return key, other, slots, tail


@pytest.mark.parametrize(
    ("freed_behind", "amount"),
    [
        pytest.param("parent", 6 * P, id="parent-reached-after-its-children"),
        pytest.param("tail", P, id="tail-of-a-split-leaf"),
    ],
)
def test_hierarchical_evict_refusal_elsewhere_in_the_walk_changes_nothing(
    closing: list[Hierarchy], freed_behind: str, amount: int
) -> None:
    h = make_hierarchy(page_size=P)
    closing.append(h)
    key, other, slots, tail = _two_level(h)
    if freed_behind == "parent":
        h.allocator.free(slots[:P].clone())  # the shared parent's first page
    else:
        # the least recent leaf (`key`'s) loses its last page: a one-page evict splits it there
        h.allocator.free(slots[-P:].clone())
    before = _snapshot(h.tree)
    free_before = h.allocator.available_size()
    with pytest.raises(NotAllocated):
        h.tree.evict(EvictRequest.full(amount))
    assert _snapshot(h.tree) == before
    assert h.allocator.available_size() == free_before
    _check_heap(h.tree)
    for k, want in ((key, slots), (other, torch.cat([slots[: 2 * P], tail]))):
        matched = h.tree.match_prefix(k)
        assert matched.prefix_len == 4 * P
        assert torch.equal(matched.device_indices, want)


def test_hierarchical_evict_ignores_a_bad_slot_it_does_not_reach(
    closing: list[Hierarchy],
) -> None:
    h = make_hierarchy(page_size=P)
    closing.append(h)
    _key, _other, slots, tail = _two_level(h)
    h.allocator.free(slots[:P].clone())  # in the parent: a one-leaf evict stays below it
    result = h.tree.evict(EvictRequest.full(2 * P))
    assert result.evicted["full"] == 2 * P
    _check_heap(h.tree)
    assert h.tree.evictable_size() == 4 * P
    assert tail.numel() == 2 * P
