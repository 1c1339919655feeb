"""SWAComponent: tombstones, window validation, window locks, revival, early-freed windows."""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import SWAAllocator
from kvstrata.testkit.trees import TreeKit, make_tree
from kvstrata.unified_radix_cache import (
    ComponentInsert,
    EvictRequest,
    InsertResult,
    RadixKey,
    SWAComponent,
    SWAInsert,
    TreeNode,
)
from kvstrata.unified_radix_cache.errors import InvalidInsert

X, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def _swa(kit: TreeKit) -> SWAComponent:
    component = kit.tree.component("swa")
    assert isinstance(component, SWAComponent)
    return component


def _node(kit: TreeKit, tokens: list[int]) -> TreeNode:
    """The node whose own tokens are `tokens`."""
    return next(n for n in kit.tree.iter_nodes() if n.tokens().tolist() == tokens)


def _insert(
    kit: TreeKit, tokens: list[int], *, dropped: int = 0
) -> tuple[torch.Tensor, InsertResult]:
    """`tokens` inserted with fresh slots, as a finished request whose first `dropped` SWA
    slots its engine already freed (the window passed them: `SWAInsert(evicted_len)`).
    Returns the slots and the result (the caller frees the duplicates)."""
    assert isinstance(kit.full, SWAAllocator)
    slots = kit.alloc(len(tokens))
    inputs: dict[str, ComponentInsert] | None = None
    if dropped:
        kit.full.free_swa(slots[:dropped])
        inputs = {"swa": SWAInsert(evicted_len=dropped)}
    return slots, kit.tree.insert(RadixKey(tokens), slots, inputs=inputs)


def _tombstoned(window: int) -> TreeKit:
    """X+Y and X+Z inserted, X+Z used last: evicting 5 SWA tokens removes leaf Y whole and
    turns the shared X into a tombstone (its full KV stays)."""
    kit = make_tree("swa", page_size=1, sliding_window=window)
    kit.put(X + Y)
    kit.put(X + Z)
    kit.tree.match_prefix(RadixKey(X + Z))
    r = kit.tree.evict(EvictRequest(targets={"swa": 5}))
    assert r.evicted == {"full": 4, "swa": 8}
    kit.check()
    return kit


def test_swa_eviction_tombstones_internal_nodes_and_removes_leaves() -> None:
    kit = _tombstoned(window=4)
    tree, swa = kit.tree, _swa(kit)
    node_x = _node(kit, X)
    assert not swa.is_live(node_x) and node_x.num_tokens == 4
    assert tree.evictable_size("full") == 8 and tree.evictable_size("swa") == 4
    assert isinstance(kit.full, SWAAllocator)
    assert kit.full.swa_available_size() == kit.full.swa_size - 4
    assert tree.match_prefix(RadixKey(X + Y)).prefix_len == 0  # Y is gone, X alone is dead


@pytest.mark.parametrize(("window", "expected"), [(4, 8), (5, 0)])
def test_match_needs_a_full_window_of_live_tokens(window: int, expected: int) -> None:
    kit = _tombstoned(window)
    m = kit.tree.match_prefix(RadixKey(X + Z))
    assert m.prefix_len == expected
    kit.check()


def test_lock_covers_one_window_and_receipt_records_it() -> None:
    kit = make_tree("swa", page_size=1, sliding_window=6)
    tree = kit.tree
    kit.put(X + Y + Z)
    kit.put(X + Y)  # split: [X+Y] [Z]
    kit.put(X)  # split: [X] [Y] [Z]
    m = tree.match_prefix(RadixKey(X + Y + Z))
    receipt = tree.lock(m.last_node)
    assert receipt.boundaries[1] == 8  # Z (4) + Y (4) >= window 6; X stays unlocked
    assert tree.protected_size("full") == 12 and tree.protected_size("swa") == 8
    assert tree.evictable_size("swa") == 4
    kit.check()
    # a split inside the locked span does not change what unlock releases
    tree.match_prefix(RadixKey([*X, 5, 6, 99]))
    kit.check()
    tree.unlock(receipt)
    assert tree.protected_size("swa") == 0 and tree.evictable_size("swa") == 12
    kit.check()


def test_locked_window_is_never_tombstoned() -> None:
    kit = make_tree("swa", page_size=1, sliding_window=4)
    tree = kit.tree
    kit.put(X + Y)
    kit.put(X)
    receipt = tree.lock(tree.match_prefix(RadixKey(X + Y)).last_node)
    r = tree.evict(EvictRequest(targets={"swa": 100}))
    assert r.evicted["swa"] == 4  # X (outside the window) only
    assert tree.match_prefix(RadixKey(X + Y)).prefix_len == 8
    tree.unlock(receipt)
    kit.check()


def test_insert_revives_a_tombstone_from_the_callers_live_slots() -> None:
    kit = _tombstoned(window=4)
    tree = kit.tree
    slots, result = _insert(kit, X + Z)
    assert result.prefix_len == 8 and result.adopted == ((0, 4),)
    duplicates = result.duplicates(slots)
    assert duplicates.tolist() == slots[4:].tolist()
    kit.full.free(duplicates)
    node_x = _node(kit, X)
    assert _swa(kit).is_live(node_x)
    assert node_x.value.tolist() == slots[:4].tolist()
    assert tree.match_prefix(RadixKey([*X, 77])).prefix_len == 4  # no tombstone left
    kit.check()


def test_a_locked_tombstone_takes_the_callers_swa_pages_under_its_full_slots() -> None:
    # A running request holds X's full slots (its SWA lock covers Z only), so an insert that
    # computed X again cannot swap X's full slots; before 0.3.0 X stayed a tombstone and the
    # inserting request, whose prefix now reads X's slots, found no SWA slots for its window.
    kit = _tombstoned(window=4)
    tree, swa = kit.tree, _swa(kit)
    assert isinstance(kit.full, SWAAllocator)
    receipt = tree.lock(tree.match_prefix(RadixKey(X + Z)).last_node)
    node_x = _node(kit, X)
    assert node_x.lock_ref and not swa.is_live(node_x)
    kept = node_x.value.tolist()
    slots = kit.alloc(8)
    theirs = kit.full.translate(slots[:4]).tolist()
    result = tree.insert(RadixKey(X + Y), slots)
    assert result.prefix_len == 4 and result.adopted == ()
    assert node_x.value.tolist() == kept  # the running request's full slots stay
    assert swa.is_live(node_x)
    assert kit.full.translate(torch.tensor(kept)).tolist() == theirs
    assert kit.full.translate(slots[:4]).tolist() == [0, 0, 0, 0]
    kit.full.free(result.duplicates(slots))
    kit.check()
    assert tree.match_prefix(RadixKey([*X, 77])).prefix_len == 4
    tree.unlock(receipt)
    kit.check()


def test_no_revival_where_the_caller_already_dropped_its_window() -> None:
    kit = _tombstoned(window=4)
    slots, result = _insert(kit, X + Z, dropped=4)
    assert result.adopted == ()
    kit.full.free(result.duplicates(slots))
    kit.check()


@pytest.mark.parametrize(("page_size", "evicted_len"), [(1, 3), (2, 3), (2, 4), (2, 8)])
def test_new_leaf_is_tombstoned_where_the_window_was_dropped(
    page_size: int, evicted_len: int
) -> None:
    kit = make_tree("swa", page_size=page_size, sliding_window=2)
    tree = kit.tree
    _insert(kit, list(range(8)), dropped=evicted_len)
    boundary = -(-evicted_len // page_size) * page_size
    assert tree.evictable_size("swa") == 8 - boundary
    assert tree.evictable_size("full") == 8
    live = sorted(n.num_tokens for n in tree.iter_nodes() if _swa(kit).is_live(n))
    assert live == ([8 - boundary] if boundary < 8 else [])
    kit.check()


def test_full_eviction_cascades_to_swa() -> None:
    kit = make_tree("swa", page_size=2, sliding_window=2)
    tree = kit.tree
    kit.put(list(range(8)))
    r = tree.evict(EvictRequest.full(3))
    assert r.evicted == {"full": 4, "swa": 4}
    assert tree.evictable_size("swa") == 4
    kit.check()


def test_swa_input_is_validated() -> None:
    kit = make_tree("swa", page_size=1)
    slots = kit.alloc(4)
    with pytest.raises(InvalidInsert):
        kit.tree.insert(RadixKey(X), slots, inputs={"swa": SWAInsert(evicted_len=5)})
    assert kit.tree.num_nodes == 0
    kit.full.free(slots)
    kit.check()


def test_swa_lru_touch_order_tombstones_ancestors_first() -> None:
    kit = make_tree("swa", page_size=1, sliding_window=2)
    tree = kit.tree
    kit.put(X + Y)
    kit.put(X + Z)
    tree.match_prefix(RadixKey(X + Y))
    tree.match_prefix(RadixKey(X + Z))
    swa = _swa(kit)
    order = [n.tokens().tolist() for n in swa.lru.nodes()]
    assert order == [Y, X, Z]


def test_pretty_print_shows_tombstones_locks_and_sizes() -> None:
    kit = _tombstoned(window=4)
    text = kit.tree.pretty_print()
    lines = text.splitlines()
    assert lines[0].startswith("root  nodes=2") and "swa: evictable=4 protected=0" in lines[0]
    assert "[1 2 3 4] 4 tok  full lock=0  swa=- lock=0" in lines[1]
    assert lines[2].startswith("    #") and "[9 10 11 12]" in lines[2] and "evictable" in lines[2]
