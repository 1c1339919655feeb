"""Issue 17 regressions: insert refuses slots it cannot own (before any change), and fixed
examples for a storage-acknowledged split, the prefetch threshold boundary and page-granular
tail eviction in hierarchical mode."""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import (
    DuplicateIndex,
    IndexOutOfRange,
    MambaSlotAllocator,
    NotAllocated,
    PagedAllocator,
    SWAAllocator,
)
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy
from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    MambaInsert,
    RadixKey,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.errors import (
    DuplicateSlot,
    HeldSlotsNotAllocated,
    InvalidInsert,
    SlotInTree,
    SlotNotAllocated,
    SlotOutOfRange,
)
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams


def _paged_tree(
    *, size: int, page_size: int, check_slots: bool = True
) -> tuple[PagedAllocator, UnifiedRadixCache]:
    """A Full-only tree over a PagedAllocator (also at page size 1, not a TokenAllocator)."""
    alloc = PagedAllocator(size=size, page_size=page_size, device="cpu")
    tree = UnifiedRadixCache([FullComponent(alloc)], page_size=page_size, check_slots=check_slots)
    return alloc, tree


def _take(alloc: PagedAllocator, num_tokens: int) -> torch.Tensor:
    slots = alloc.alloc(num_tokens)
    assert slots is not None
    return slots


def _snapshot(tree: UnifiedRadixCache) -> tuple[object, ...]:
    nodes = sorted((n.id, n.key, n.value.tolist()) for n in tree.iter_nodes())
    return (tuple(nodes), tree.evictable_size(), tree.num_nodes, tree.inserted_tokens)


# ---- item 1: insert refuses slots ------------------------------------------------------------


def test_issue_example_is_refused_at_insert_and_evict_stays_whole() -> None:
    alloc, tree = _paged_tree(size=64, page_size=1)
    before = _snapshot(tree)
    with pytest.raises(SlotNotAllocated) as never:
        tree.insert(RadixKey(range(16)), torch.arange(1, 17))  # never allocated
    assert isinstance(never.value, NotAllocated)
    assert isinstance(never.value, InvalidInsert)
    v = _take(alloc, 8)
    with pytest.raises(DuplicateSlot) as twice:
        tree.insert(RadixKey(range(100, 116)), torch.cat([v, v]))
    assert isinstance(twice.value, DuplicateIndex)
    assert _snapshot(tree) == before
    tree.evict(EvictRequest.full(16))
    tree.check_integrity(held={"full": 8})  # v is still the caller's
    alloc.free(v)
    assert alloc.available_size() == 64
    alloc.check_integrity()


def _full_sums(
    tree: UnifiedRadixCache, full: FullComponent, alloc: PagedAllocator
) -> tuple[object, ...]:
    return (_snapshot(tree), full.evictable_size, full.evicted_total, alloc.available_size())


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("amount", [64, 36])  # everything; ends inside leaf c (truncation)
def test_evict_of_slots_freed_behind_the_tree_raises_with_nothing_changed(
    page_size: int, events: bool, amount: int
) -> None:
    alloc = PagedAllocator(size=128, page_size=page_size, device="cpu")
    full = FullComponent(alloc)
    tree = UnifiedRadixCache([full], page_size=page_size, enable_events=events)
    held: list[torch.Tensor] = []
    # A shared 8-token prefix, then three branches (LRU order: a, b, c) and one more key: the
    # prefix node becomes a leaf mid-eviction, so the roll-back must take it off the heap again.
    for tail in (range(100, 108), range(200, 216), range(300, 316), range(400, 416)):
        tokens = [*range(8), *tail] if tail.start < 400 else list(tail)
        slots = alloc.alloc(len(tokens))
        assert slots is not None
        result = tree.insert(RadixKey(tokens), slots)
        alloc.free(result.duplicates(slots))
        held.append(slots[result.prefix_len :])
    tree.take_events()
    # The engine frees branch c's own slots itself (a double free in waiting).
    alloc.free(held[2])
    before = _full_sums(tree, full, alloc)
    with pytest.raises(HeldSlotsNotAllocated) as caught:
        tree.evict(EvictRequest.full(amount))
    assert isinstance(caught.value, NotAllocated)
    assert _full_sums(tree, full, alloc) == before
    assert tree.take_events() == []
    # The heap survived: a small eviction still takes the least recent leaf (branch a) only.
    done = tree.evict(EvictRequest.full(8))
    assert done.evicted["full"] == 8
    assert tree.match_prefix(RadixKey([*range(8), *range(100, 108)])).prefix_len == 8
    assert tree.match_prefix(RadixKey([*range(8), *range(200, 216)])).prefix_len == 24
    assert tree.match_prefix(RadixKey(range(400, 416))).prefix_len == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_out_of_range_and_page_zero_slots_are_refused(page_size: int) -> None:
    alloc, tree = _paged_tree(size=32, page_size=page_size)
    good = _take(alloc, 8)
    bad = good.clone()
    bad[-1] = 32 + page_size + 5  # past the last page
    with pytest.raises(SlotOutOfRange) as outside:
        tree.insert(RadixKey(range(8)), bad)
    assert isinstance(outside.value, IndexOutOfRange)
    zero = good.clone()
    zero[:page_size] = torch.arange(page_size)  # page 0 is never handed out
    with pytest.raises(SlotNotAllocated):
        tree.insert(RadixKey(range(8)), zero)
    assert tree.num_nodes == 0
    assert tree.insert(RadixKey(range(8)), good).inserted_len == 8
    tree.check_integrity()


def test_freed_page_is_refused_with_page_size_four() -> None:
    alloc, tree = _paged_tree(size=32, page_size=4)
    slots = _take(alloc, 8)
    alloc.free(slots[4:])  # second page back to the allocator
    with pytest.raises(SlotNotAllocated):
        tree.insert(RadixKey(range(8)), slots)
    assert tree.num_nodes == 0


def test_same_slots_under_two_keys_are_refused() -> None:
    alloc, tree = _paged_tree(size=64, page_size=1)
    slots = _take(alloc, 8)
    tree.insert(RadixKey(range(8)), slots)
    before = _snapshot(tree)
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(50, 58)), slots)
    with pytest.raises(SlotInTree):  # the tree's slots past cached_len are not the caller's
        tree.insert(RadixKey([*range(4), *range(60, 64)]), slots)
    assert _snapshot(tree) == before
    # Once evicted (freed), the slots may come back under another key.
    tree.evict(EvictRequest.full(8))
    again = _take(alloc, 8)
    assert tree.insert(RadixKey(range(50, 58)), again).inserted_len == 8
    tree.check_integrity()


def test_locked_prefix_slots_before_cached_len_are_accepted() -> None:
    alloc, tree = _paged_tree(size=64, page_size=1)
    first = _take(alloc, 4)
    tree.insert(RadixKey(range(4)), first)
    hit = tree.match_prefix(RadixKey(range(8)))
    more = _take(alloc, 4)
    value = torch.cat([hit.device_indices, more])
    result = tree.insert(RadixKey(range(8)), value, cached_len=4)
    assert (result.prefix_len, result.inserted_len) == (4, 4)
    tree.check_integrity()


def test_check_slots_false_trusts_the_caller() -> None:
    _, tree = _paged_tree(size=64, page_size=1, check_slots=False)
    assert tree.insert(RadixKey(range(16)), torch.arange(1, 17)).inserted_len == 16


def test_swa_tree_checks_full_slots() -> None:
    kit = make_tree("swa", size=32, page_size=1)
    assert isinstance(kit.full, SWAAllocator)
    slots = kit.alloc(6)
    kit.full.free(slots[3:])
    with pytest.raises(SlotNotAllocated):
        kit.tree.insert(RadixKey(range(6)), slots)
    assert kit.tree.num_nodes == 0
    kit.put(list(range(10, 16)))
    taken = kit.alloc(6)
    with pytest.raises(DuplicateSlot):
        kit.tree.insert(RadixKey(range(20, 26)), torch.cat([taken[:3], taken[:3]]))
    kit.full.free(torch.cat([slots[:3], taken]))
    kit.check()


def test_mamba_state_slot_must_be_allocated() -> None:
    kit = make_tree("mamba", size=32, page_size=1)
    assert isinstance(kit.mamba, MambaSlotAllocator)
    slots = kit.alloc(4)
    free_state = kit.alloc_state()
    kit.mamba.free(free_state)
    with pytest.raises(SlotNotAllocated):
        kit.tree.insert(
            RadixKey(range(4)), slots, inputs={"mamba": MambaInsert(slot=int(free_state))}
        )
    assert kit.tree.num_nodes == 0
    kit.full.free(slots)
    kit.check()


# ---- items 9-11: hierarchical mode -----------------------------------------------------------

P = 4


def _hier(closing: list[Hierarchy], **kw: object) -> Hierarchy:
    h = make_hierarchy(page_size=P, **kw)  # type: ignore[arg-type]
    closing.append(h)
    return h


def _put(h: Hierarchy, tokens: list[int]) -> tuple[RadixKey, torch.Tensor]:
    key = RadixKey(tokens)
    slots = h.allocator.alloc(len(tokens))
    assert slots is not None
    result = h.cache.insert(key, slots)
    h.allocator.free(result.duplicates(slots))
    return key, slots


def test_split_of_a_stored_node_keeps_in_storage_on_both_halves(
    closing: list[Hierarchy],
) -> None:
    h = _hier(closing, storage=MemoryStorage(capacity_bytes=1 << 24))
    key, _ = _put(h, list(range(1, 3 * P + 1)))
    h.cache.drain()
    stored = node_at(h.tree, key)
    assert stored is not None and stored.in_storage
    # A key that leaves the stored node after one page splits it (no drain: only the split
    # can carry the flag to the new upper half).
    _put(h, [*range(1, P + 1), 70, 71, 72, 73])
    lower = node_at(h.tree, key)
    assert lower is not None and lower is stored and lower.num_tokens == 2 * P
    upper = lower.parent
    assert upper is not None and upper.num_tokens == P and upper.parent is h.tree.root
    assert upper.in_storage and lower.in_storage
    h.cache.drain()
    h.cache.check_integrity()


def test_prefetch_starts_exactly_at_the_threshold(closing: list[Hierarchy]) -> None:
    params = TierParams(prefetch_threshold=3 * P)
    h = _hier(closing, storage=MemoryStorage(capacity_bytes=1 << 24), params=params)
    _put(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    # 2 pages on the device; host copies of device nodes add no host hit beyond them.
    below = h.cache.match_prefix(RadixKey(list(range(1, 5 * P))))  # 3 pages - 1 token beyond
    assert (below.device.prefix_len, below.host_hit_len) == (2 * P, 0)
    assert below.prefetch_id is None
    fewer = h.cache.match_prefix(RadixKey(list(range(1, 4 * P + 1))))  # 2 pages beyond
    assert fewer.prefetch_id is None
    at = h.cache.match_prefix(RadixKey(list(range(1, 5 * P + 1))))  # exactly 3 pages beyond
    assert (at.device.prefix_len, at.host_hit_len) == (2 * P, 0)
    assert at.prefetch_id is not None
    assert h.cache.finish_prefetch(at.prefetch_id) == 0  # storage holds none of those pages
    h.cache.check_integrity()


@pytest.mark.parametrize("amount", [1, P + 1, 2 * P - 1])
def test_hierarchical_tail_eviction_is_page_granular(closing: list[Hierarchy], amount: int) -> None:
    h = _hier(closing)
    key, slots = _put(h, list(range(1, 4 * P + 1)))
    h.cache.drain()  # the leaf has a host copy: its tail goes off the device and stays
    pages = -(-amount // P)
    free_before = h.allocator.available_size()
    assert h.cache.evict_device(amount) == pages * P
    assert h.allocator.available_size() == free_before + pages * P
    m = h.cache.match_prefix(key)
    kept = (4 - pages) * P
    assert m.device.prefix_len == kept
    assert m.device.device_indices.tolist() == slots[:kept].tolist()
    assert m.host_hit_len == pages * P
    tail = m.device.last_host_node
    assert tail is not None and not tail.on_device and tail.num_tokens == pages * P
    h.cache.check_integrity()


def test_hierarchical_tail_eviction_across_two_leaves(closing: list[Hierarchy]) -> None:
    h = _hier(closing)
    first, _ = _put(h, list(range(1, 2 * P + 1)))
    second, slots = _put(h, list(range(100, 100 + 3 * P)))
    h.cache.drain()
    h.cache.match_prefix(second)  # `first` is the LRU device leaf
    assert h.cache.evict_device(2 * P + P + 1) == 4 * P  # all of first, 2 pages of second
    assert h.cache.match_prefix(first).device.prefix_len == 0
    m = h.cache.match_prefix(second)
    assert m.device.prefix_len == P and m.host_hit_len == 2 * P
    assert m.device.device_indices.tolist() == slots[:P].tolist()
    h.cache.check_integrity()
