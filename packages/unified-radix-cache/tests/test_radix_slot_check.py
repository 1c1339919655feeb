"""The insert slot check's own range, repeat and held tests (`slot_checks.py`), over a sink
without `check_allocated` (so the checker alone decides), and its one-walk fast path: a refused
insert splits nothing, an accepted one marks exactly the slots it adopts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.unified_radix_cache import EvictRequest, FullComponent, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.errors import DuplicateSlot, SlotInTree, SlotOutOfRange


class _Sink:
    """A slot sink with a large pool and no `check_allocated` (as a trusting engine's)."""

    device = torch.device("cpu")

    def __init__(self, size: int) -> None:
        self.size = size
        self.freed: list[int] = []

    def available_size(self) -> int:
        return self.size

    def free(self, indices: torch.Tensor) -> None:
        self.freed += indices.tolist()


def _tree(size: int = 1 << 40, page_size: int = 1) -> UnifiedRadixCache:
    return UnifiedRadixCache([FullComponent(_Sink(size))], page_size=page_size)


def _state(tree: UnifiedRadixCache) -> tuple[object, ...]:
    nodes = sorted((n.id, n.key, n.value.tolist()) for n in tree.iter_nodes())
    return (tuple(nodes), tree.num_nodes, tree.evictable_size())


@pytest.mark.parametrize(
    "bad",
    [-1, -5, -(1 << 22), -(1 << 32), -(1 << 32) - 3, (1 << 40) + 7, 1 << 62],
)
def test_slots_outside_the_pool_are_refused(bad: int) -> None:
    tree = _tree()
    tree.insert(RadixKey(range(4)), np.arange(10, 14))
    before = _state(tree)
    value = np.arange(20, 28)
    value[5] = bad
    with pytest.raises(SlotOutOfRange):
        tree.insert(RadixKey([0, 1, 50, 51, 52, 53, 54, 55]), value)  # would split [0..3]
    assert _state(tree) == before


def test_a_slot_past_the_table_grows_it_and_is_marked() -> None:
    tree = _tree()
    far = np.arange((1 << 23) + 5, (1 << 23) + 13)
    assert tree.insert(RadixKey(range(8)), far).inserted_len == 8
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(100, 108)), far)
    tree.evict(EvictRequest.full(8))
    assert tree.insert(RadixKey(range(100, 108)), far).inserted_len == 8  # freed: free again


def test_repeats_are_refused_and_leave_no_mark() -> None:
    tree = _tree()
    value = np.array([3, 4, 5, 3, 6, 7, 8, 9])
    with pytest.raises(DuplicateSlot):
        tree.insert(RadixKey(range(8)), value)
    assert tree.num_nodes == 0
    # Nothing of the refused call stayed marked: the same slots are fine once distinct.
    assert tree.insert(RadixKey(range(8)), np.array([3, 4, 5, 10, 6, 7, 8, 9])).inserted_len == 8


def test_strided_slots_are_checked_like_contiguous_ones() -> None:
    tree = _tree()
    base = torch.arange(40, 56)
    assert tree.insert(RadixKey(range(8)), base[::2]).inserted_len == 8
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(100, 108)), base.numpy()[::2].copy())
    with pytest.raises(DuplicateSlot):
        tree.insert(RadixKey(range(200, 204)), torch.tensor([1, 1, 2, 3])[::1])


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_walk_marks_exactly_the_adopted_slots(page_size: int) -> None:
    tree = _tree(page_size=page_size)
    tree.insert(RadixKey(range(8)), np.arange(100, 108))
    # The same prefix again with other slots: the tree keeps its own, the caller's duplicates
    # are not marked (they go back to the caller's pool and may come back).
    result = tree.insert(RadixKey([*range(4), *range(50, 54)]), np.arange(200, 208))
    assert (result.prefix_len, result.inserted_len) == (4, 4)
    assert tree.insert(RadixKey(range(300, 304)), np.arange(200, 204)).inserted_len == 4
    with pytest.raises(SlotInTree):  # 204..207 were adopted under the second key
        tree.insert(RadixKey(range(400, 404)), np.arange(204, 208))


def test_slots_claimed_as_cached_are_marked_when_adopted() -> None:
    tree = _tree()
    # cached_len past what the tree holds: the tree adopts value[:8] without checking it
    # (the caller says it got them from this tree) and must still see them as held.
    tree.insert(RadixKey(range(8)), np.arange(60, 68), cached_len=4)
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(100, 104)), np.arange(60, 64))
