"""A Full-only insert of the key object the match just before walked reuses that walk (no second
descent), and only while the walk still holds: any split or new node drops it, and so does a
removal or a cut of a node unless the walk's end is locked. Also the slot check's fast path for
a run of consecutive slots (`slot_checks.py`): it refuses what the general path refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.pool.native import disabled
from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import EvictRequest, FullComponent, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache import tree as tree_module
from kvstrata.unified_radix_cache.errors import (
    DuplicateSlot,
    SlotInTree,
    SlotNotAllocated,
    SlotOutOfRange,
)
from kvstrata.unified_radix_cache.walk import descend


def _count_descents(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return descend(*args, **kwargs)

    monkeypatch.setattr(tree_module, "descend", counted)
    return calls


def _same_as_fresh(tree: UnifiedRadixCache, tokens: list[int]) -> int:
    """The prefix a fresh key object (a full walk) finds now."""
    return tree.match_prefix(RadixKey(tokens)).prefix_len


@pytest.mark.parametrize("check_slots", [True, False])
def test_insert_after_its_match_walks_once(
    monkeypatch: pytest.MonkeyPatch, check_slots: bool
) -> None:
    with disabled():  # counts the Python walk (test_radix_native.py counts the compiled one)
        kit = make_tree("full", page_size=4)
    kit.tree.check_slots = check_slots
    kit.put(list(range(8)))
    calls = _count_descents(monkeypatch)
    key = RadixKey([*range(4), 50, 51, 52, 53, 54, 55, 56, 57])
    assert kit.tree.match_prefix(key).prefix_len == 4  # splits [0..7] after 4
    slots = kit.alloc(12)
    result = kit.tree.insert(key, slots)
    assert calls[0] == 1
    assert (result.prefix_len, result.inserted_len) == (4, 8)
    kit.full.free(result.duplicates(slots))
    # Another key object with the same tokens walks again.
    assert kit.tree.insert(RadixKey(list(key.tokens())), slots).inserted_len == 0
    assert calls[0] == 2
    kit.check()


@pytest.mark.parametrize("evict", [4, 8, 100])
@pytest.mark.parametrize("locked", [True, False])
def test_evict_between_match_and_insert(evict: int, locked: bool) -> None:
    """The bench's order: match, (lock), evict, insert, (unlock). Without the lock the evict
    may remove or cut the matched nodes; the insert then walks again."""
    kit = make_tree("full", page_size=4)
    tree = kit.tree
    kit.put(list(range(8)))
    tokens = [*range(8), 60, 61, 62, 63]
    key = RadixKey(tokens)
    match = tree.match_prefix(key)
    assert match.prefix_len == 8
    receipt = tree.lock(match.last_node) if locked else None
    tree.evict(EvictRequest.full(evict))
    kept = 8 if locked else max(0, 8 - evict)
    assert _same_as_fresh(tree, tokens) == kept
    slots = kit.alloc(12)
    result = tree.insert(key, slots)
    assert (result.prefix_len, result.inserted_len) == (kept, 12 - kept)
    kit.full.free(result.duplicates(slots))
    if receipt is not None:
        tree.unlock(receipt)
    assert _same_as_fresh(tree, tokens) == 12
    kit.check()


def test_an_insert_between_drops_the_walk() -> None:
    kit = make_tree("full", page_size=1)
    tree = kit.tree
    kit.put(list(range(4)))
    key = RadixKey([0, 1, 2, 3, 4, 5])
    assert tree.match_prefix(key).prefix_len == 4
    kit.put([0, 1, 2, 3, 4, 9])  # adds [4] under the matched end, then splits it
    slots = kit.alloc(6)
    result = tree.insert(key, slots)
    assert (result.prefix_len, result.inserted_len) == (5, 1)
    kit.full.free(result.duplicates(slots))
    assert _same_as_fresh(tree, [0, 1, 2, 3, 4, 5]) == 6
    kit.check()


def test_a_limited_match_is_not_reused() -> None:
    kit = make_tree("full", page_size=1)
    tree = kit.tree
    kit.put(list(range(6)))
    key = RadixKey([*range(6), 7])
    assert tree.match_prefix(key, max_len=3).prefix_len == 3
    slots = kit.alloc(7)
    result = tree.insert(key, slots)
    assert (result.prefix_len, result.inserted_len) == (6, 1)
    kit.full.free(result.duplicates(slots))
    kit.check()


def test_reset_between_drops_the_walk() -> None:
    kit = make_tree("full", page_size=1)
    tree = kit.tree
    kit.put(list(range(4)))
    key = RadixKey([0, 1, 2, 3, 4])
    assert tree.match_prefix(key).prefix_len == 4
    tree.reset()
    slots = kit.alloc(5)
    assert tree.insert(key, slots).inserted_len == 5
    kit.check()


# -- the slot check's run fast path ----------------------------------------------------------


class _Sink:
    """A large pool without `check_allocated`: the checker alone decides."""

    device = torch.device("cpu")
    size = 1 << 40

    def available_size(self) -> int:
        return 1 << 40

    def free(self, indices: torch.Tensor) -> None:
        assert indices.numel() >= 0


def _tree() -> UnifiedRadixCache:
    return UnifiedRadixCache([FullComponent(_Sink())], page_size=1)


def test_a_held_run_is_refused_before_any_change() -> None:
    tree = _tree()
    tree.insert(RadixKey(range(8)), np.arange(100, 108))
    nodes = tree.num_nodes
    with pytest.raises(SlotInTree):  # overlaps the held run in its middle
        tree.insert(RadixKey([0, 1, 50, 51]), np.arange(104, 108))
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(200, 210)), np.arange(98, 108))
    assert tree.num_nodes == nodes
    # The refused calls marked nothing: the runs next to the held one are free.
    assert tree.insert(RadixKey(range(300, 302)), np.arange(98, 100)).inserted_len == 2
    assert tree.insert(RadixKey(range(400, 404)), np.arange(108, 112)).inserted_len == 4
    assert tree.evictable_size() == 14


def test_a_shuffled_or_negative_run_takes_the_general_path() -> None:
    tree = _tree()
    # first and last as a run's, the middle shuffled: distinct, so accepted, and marked.
    assert tree.insert(RadixKey(range(4)), np.array([10, 12, 11, 13])).inserted_len == 4
    with pytest.raises(SlotInTree):
        tree.insert(RadixKey(range(10, 14)), np.arange(10, 14))
    with pytest.raises(DuplicateSlot):  # first and last as a run's, a slot twice
        tree.insert(RadixKey(range(20, 24)), np.array([20, 21, 21, 23]))
    with pytest.raises(SlotOutOfRange):
        tree.insert(RadixKey(range(30, 38)), np.arange(-3, 5))
    assert tree.num_nodes == 1 and tree.evictable_size() == 4


def test_runs_on_a_checked_allocator_and_a_hybrid_tree() -> None:
    """The run path still asks the allocator (a free run is refused), and a hybrid tree's
    check (which marks after its insert) refuses a run it holds."""
    kit = make_tree("swa", page_size=1, size=64)
    slots = kit.alloc(8)
    kit.tree.insert(RadixKey(range(8)), slots)
    with pytest.raises(SlotInTree):
        kit.tree.insert(RadixKey(range(100, 108)), slots)
    free_run = kit.alloc(4)
    kit.full.free(free_run)
    with pytest.raises(SlotNotAllocated):
        kit.tree.insert(RadixKey(range(200, 204)), free_run)
    kit.check()
