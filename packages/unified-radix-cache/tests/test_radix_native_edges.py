"""The compiled radix core (`radix_core.c`) on the inputs its review found unsafe: slots that
share memory with the held table, node keys that are not whole pages, an eviction that raises
midway, eviction targets of 2**63 and more, classes the compiled loop does not mirror, and the
held marks each slot check leaves. Each case runs on both paths where the tree is involved."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

from kvstrata.allocator.counting import SlotCounter
from kvstrata.pool.native import disabled
from kvstrata.testkit.trees import make_full_allocator, make_tree
from kvstrata.unified_radix_cache import EvictRequest, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.native_core import native_core
from kvstrata.unified_radix_cache.policies import LeafHeap
from kvstrata.unified_radix_cache.tree_view import TreeView

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")
#: Tree-level cases run on the compiled path (when built) and on the Python one.
PATHS = (False, True) if CORE is not None else (True,)


@needs_core
def test_slots_aliasing_the_held_table_go_to_the_python_check() -> None:
    """Marks written into the table would change the slots still to read: slot 1's mark
    turns slots[0] (1) into 2**32 + 1, and an undo indexing with it wrote 16 GiB away."""
    assert CORE is not None
    held = np.zeros(8, dtype=np.int32)
    held[0] = 1  # slots[0] == 1
    held[2] = 1  # slots[1] == 1: a repeat, found after slot 1 was marked
    slots = held.view(np.int64)
    before = held.copy()
    assert CORE.check_slots(slots, 0, 2, held, True) is False
    assert CORE.check_slots(slots[2:], 0, 2, held, True) is False  # overlapping, offset
    assert np.array_equal(held, before)
    # Disjoint buffers still take the compiled check.
    assert CORE.check_slots(np.array([5, 6], dtype=np.int64), 0, 2, held, True) is True


@needs_core
@pytest.mark.parametrize("cut", [24, 8, 0])  # 1.5 pages, half a page, empty
def test_a_node_key_of_part_pages_is_refused_not_read_past(cut: int) -> None:
    assert CORE is not None
    kit = make_tree("full", page_size=2)
    kit.put([1, 2, 3, 4])
    (leaf,) = kit.tree.iter_nodes()
    good = leaf.key
    leaf.key = good[:cut]
    data = RadixKey([1, 2, 3, 4]).token_bytes()
    with pytest.raises(ValueError, match="not a whole number"):
        CORE.walk(kit.tree.root, 16, None, data, 32, None)
    with pytest.raises(ValueError, match="not a whole number"):
        kit.tree.match_prefix(RadixKey([1, 2, 3, 4]))
    leaf.key = good
    kit.check()


class Unorderable:
    """A priority whose every comparison raises `error` (what a heap push then raises)."""

    def __init__(self, error: type[BaseException]) -> None:
        self.error = error

    def __eq__(self, other: object) -> bool:
        raise self.error("no order")

    def __lt__(self, other: object) -> bool:
        raise self.error("no order")

    __hash__ = None  # pyright: ignore[reportAssignmentType]


@pytest.mark.parametrize("error", [TypeError, MemoryError, KeyboardInterrupt])
def test_an_eviction_raising_midway_leaves_the_counters_true(error: type[BaseException]) -> None:
    """Two leaves go, then their parent's heap.push raises: both paths count the two leaves
    (sizes, evicted total, node count) and the tree passes check_integrity."""
    states = []
    for off in PATHS:
        kit = make_tree(python_paths=off, size=64, policy="priority")
        kit.put([1, 2, 3])
        kit.put([1, 2, 4])
        kit.put([5, 6], priority=5)
        kit.put([7, 8], priority=5)
        tree = kit.tree
        assert (tree._full.leaf_evictor is not None) is (tree._native is not None)
        (upper,) = [n for n in tree.iter_nodes() if n.num_tokens == 2 and n.children]
        upper.priority = Unorderable(error)  # pyright: ignore[reportAttributeAccessIssue]
        with pytest.raises(error, match="no order"):
            tree.evict(EvictRequest.full(100))
        tree.flush_pending()
        states.append(
            (tree.num_nodes, tree.evictable_size(), tree._full.evicted_total, len(tree._heap))
        )
        upper.priority = 0  # check_integrity's own comparisons need an ordered priority
        kit.check()
    assert len(set(states)) == 1
    assert states[0][:3] == (3, 6, 2)


@pytest.mark.parametrize("amount", [2**63 - 1, 2**63, 10**30])
def test_a_huge_eviction_target_frees_everything_on_both_paths(amount: int) -> None:
    results = []
    for off in PATHS:
        kit = make_tree(python_paths=off, size=64, page_size=4)
        kit.put(list(range(10)))
        kit.put([*range(4), 9, 9, 9, 9, 9])
        got = kit.tree.evict(EvictRequest.full(amount))
        results.append((got.evicted, got.nodes_removed, kit.tree.num_nodes))
        kit.check()
    assert all(r == results[0] for r in results)
    assert results[0][2] == 0


@needs_core
def test_the_compiled_eviction_clamps_its_target() -> None:
    assert CORE is not None
    kit = make_tree("full", page_size=4)
    kit.put(list(range(8)))
    tree = kit.tree
    progress = bytearray(16)
    args = (4, 32, tree.root, (), [], None, None, progress, False)
    assert CORE.evict(tree._heap, -(2**70), *args) == (0, 0, None)
    assert CORE.evict(tree._heap, -1, *args) == (0, 0, None)
    with pytest.raises(TypeError, match="progress"):
        CORE.evict(tree._heap, 4, 4, 32, tree.root, (), [], None, None, bytearray(8), False)
    kit.check()


class SubFull(FullComponent):
    pass


class SubHeap(LeafHeap):
    pass


def _tree(full: FullComponent) -> UnifiedRadixCache:
    return UnifiedRadixCache([full], page_size=1)


@needs_core
def test_the_compiled_eviction_only_runs_for_the_exact_classes() -> None:
    assert _tree(FullComponent(make_full_allocator(size=32, page_size=1)))._full.leaf_evictor
    assert _tree(SubFull(make_full_allocator(size=32, page_size=1)))._full.leaf_evictor is None
    full = FullComponent(make_full_allocator(size=32, page_size=1))

    def bind(tree: TreeView[Any], index: int) -> None:
        FullComponent.bind(full, tree, index)
        full.heap = SubHeap(tree.policy)

    full.bind = bind  # pyright: ignore[reportAttributeAccessIssue]
    tree = _tree(full)
    assert type(tree._heap) is SubHeap
    assert tree._full.leaf_evictor is None
    slots = full.allocator.alloc(3)
    assert slots is not None
    tree.insert(RadixKey([1, 2, 3]), slots)
    assert tree.evict(EvictRequest.full(3)).num_evicted() == 3
    tree.check_integrity()


def test_held_marks_flag_the_same_slots_on_both_paths() -> None:
    """`held` is a flag table (zero or not): the compiled check marks 1, the Python scatter
    path keeps its stamps 1..n. Both trees flag the same slots and pass their checks, and
    a slot given back clears on both."""
    flags = []
    for off in PATHS:
        kit = make_tree(python_paths=off, size=64)
        kit.tree.check_slots = True
        kit.put([1, 2, 3])
        mine = kit.alloc(8).flip(0)  # descending: not a run, the Python scatter path
        kit.full.free(mine[4:])
        kit.tree.insert(RadixKey([4, 5, 6, 7]), mine[:4])
        held = kit.tree._full.held
        assert held is not None
        flags.append(np.flatnonzero(held).tolist())
        kit.check()
        kit.tree.evict(EvictRequest.full(100))
        assert not held.any()
        kit.check()
    assert all(f == flags[0] for f in flags)


@needs_core
def test_a_refused_marking_pass_falls_back_to_the_python_check() -> None:
    """The compiled check passes without keep, then its marking pass refuses: the Python
    check decides and marks (the second answer was ignored before)."""
    assert CORE is not None

    def second_refuses(*args: Any) -> bool:
        return False if args[4] else CORE.check_slots(*args)

    kit = make_tree("full", size=64)
    checker = kit.tree._slot_checker
    assert checker is not None and checker._allocator is not None
    checker._native = second_refuses
    _, slots = kit.put([1, 2, 3])
    held = kit.tree._full.held
    assert held is not None
    assert sorted(np.flatnonzero(held).tolist()) == sorted(slots.tolist())
    kit.check()


@needs_core
def test_the_compiled_lock_walks_refuse_bad_input_before_any_change() -> None:
    assert CORE is not None
    kit = make_tree("full", page_size=1)
    kit.put([1, 2, 3])
    tree = kit.tree
    (leaf,) = tree.iter_nodes()
    members = tree._heap._members
    with pytest.raises(TypeError, match="members"):
        CORE.lock_path(leaf, tree.root, [])  # pyright: ignore[reportArgumentType]
    other = make_tree("full", page_size=1)
    assert CORE.lock_path(leaf, other.tree.root, members) is None  # a foreign anchor
    with pytest.raises(AssertionError, match="below zero"):
        CORE.unlock_path(leaf, tree._heap)  # never locked
    leaf.lock_ref = "one"  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError, match="lock_ref"):
        CORE.lock_path(leaf, tree.root, members)
    leaf.lock_ref = 0
    assert leaf.id in members
    kit.check()
    # Through the tree: the same receipts and sizes as the Python loops.
    receipt = tree.lock(leaf)
    assert leaf.lock_ref == 1 and leaf.id not in members
    assert (tree.protected_size(), tree.evictable_size()) == (3, 0)
    kit.check()
    tree.unlock(receipt)
    assert leaf.lock_ref == 0 and leaf.id in members
    kit.check()


@needs_core
def test_the_compiled_lock_walks_follow_the_compiled_eviction_rule() -> None:
    plain = _tree(FullComponent(make_full_allocator(size=32, page_size=1)))
    assert plain._full.path_lock is not None and plain._full.path_unlock is not None
    sub = _tree(SubFull(make_full_allocator(size=32, page_size=1)))
    assert sub._full.path_lock is None and sub._full.path_unlock is None
    plain._full.drop_compiled()
    assert plain._full.path_lock is None and plain._full.leaf_evictor is None


@pytest.mark.parametrize("off", PATHS)
def test_a_priority_that_is_not_an_integer_is_refused_before_any_change(off: bool) -> None:
    """A priority is compared with other nodes' inside evictions and unlocks, where a raising
    comparison would leave the tree half changed; it is refused at insert, before the slot
    check marks anything (a retry used to get SlotInTree)."""
    from kvstrata.unified_radix_cache.errors import InvalidInsert

    kit = make_tree(python_paths=off, policy="priority")
    slots = kit.alloc(3)
    with pytest.raises(InvalidInsert, match="priority"):
        kit.tree.insert(RadixKey([1, 2, 3]), slots, priority=None)  # pyright: ignore[reportArgumentType]
    assert kit.tree.num_nodes == 0
    kit.tree.insert(RadixKey([1, 2, 3]), slots, priority=np.int64(2))  # pyright: ignore[reportArgumentType]
    (node,) = kit.tree.iter_nodes()
    assert type(node.priority) is int and node.priority == 2
    with pytest.raises(InvalidInsert, match="priority"):
        kit.tree.begin_request(RadixKey([1, 2, 3, 4]), priority=1.5)  # pyright: ignore[reportArgumentType]
    assert kit.tree.num_locked == 0
    kit.check()


@pytest.mark.parametrize("off", PATHS)
def test_eviction_targets_must_be_integers_and_are_the_same_on_both_paths(off: bool) -> None:
    from kvstrata.unified_radix_cache.errors import InvalidEvictRequest

    with pytest.raises(InvalidEvictRequest, match="integer"):
        EvictRequest(targets={"full": 2.5})  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidEvictRequest, match="integer"):
        EvictRequest.full(2.5)  # pyright: ignore[reportArgumentType]
    request = EvictRequest.full(np.int64(2))  # pyright: ignore[reportArgumentType]
    assert type(request.targets["full"]) is int
    kit = make_tree(python_paths=off)
    kit.put([1, 2, 3, 4])
    assert kit.tree.evict(request).evicted == {"full": 2}
    kit.check()


def test_a_tree_subclass_keeps_its_overrides_on_the_python_paths() -> None:
    """The compiled eviction inlines `remove_leaf`: a subclass of the tree does not get it."""
    removed: list[int] = []

    class Counting(UnifiedRadixCache):
        def remove_leaf(self, node: Any, *, evicted: bool) -> int:
            removed.append(node.id)
            return super().remove_leaf(node, evicted=evicted)

    tree = Counting([FullComponent(make_full_allocator(size=64, page_size=1))], page_size=1)
    slots = tree._full.allocator.alloc(4)
    assert slots is not None
    tree.insert(RadixKey([1, 2, 3, 4]), slots)
    tree.evict(EvictRequest.full(4))
    assert len(removed) == 1
    tree.check_integrity()


@needs_core
def test_the_compiled_lock_refuses_a_count_at_its_maximum_before_any_change() -> None:
    """A lock count of 2**63 - 1 (a corrupted tree) would overflow in C: refused first."""
    kit = make_tree(page_size=1)
    kit.put([1, 2, 3])
    (leaf,) = kit.tree.iter_nodes()
    leaf.lock_ref = 2**63 - 1
    sizes = kit.tree._full.evictable_size, kit.tree._full.protected_size
    with pytest.raises(OverflowError, match="maximum"):
        kit.tree.lock(leaf)
    assert leaf.lock_ref == 2**63 - 1
    assert (kit.tree._full.evictable_size, kit.tree._full.protected_size) == sizes
    assert kit.tree.num_locked == 0


@needs_core
def test_drain_joins_the_queued_slots_and_clears_their_held_flags() -> None:
    """`drain` is `FullComponent.flush`'s array work: one bytearray of every queued slot in
    order, the list emptied, the flags of slots inside the table cleared (one past it was
    never marked), None for nothing queued."""
    assert CORE is not None
    held = np.zeros(8, dtype=np.int32)
    held[[1, 2, 5]] = 1
    pending = [np.array([5, 1], dtype=np.int64), np.array([], dtype=np.int64), np.array([9])]
    joined = CORE.drain(pending, held)
    assert joined is not None
    assert np.frombuffer(joined, dtype=np.int64).tolist() == [5, 1, 9]
    assert pending == []
    assert np.flatnonzero(held).tolist() == [2]
    assert CORE.drain(pending, held) is None
    assert CORE.drain([np.array([], dtype=np.int64)], None) is None
    assert CORE.drain([np.array([3, 4], dtype=np.int64)], None) == np.array([3, 4]).tobytes()


@needs_core
def test_drain_refuses_a_bad_queue_before_any_change() -> None:
    assert CORE is not None
    held = np.ones(8, dtype=np.int32)
    for bad in (np.array([1.0, 2.0]), np.array([1, 2], dtype=np.int32), [1, 2]):
        pending: list[Any] = [np.array([1], dtype=np.int64), bad]
        with pytest.raises((ValueError, TypeError)):
            CORE.drain(pending, held)
        assert len(pending) == 2 and held.all()
    with pytest.raises(TypeError, match="list"):
        CORE.drain((np.array([1]),), held)
    with pytest.raises(ValueError, match="1-D buffer"):
        CORE.drain([np.array([1])], np.ones(8, dtype=np.int64))
    # Strided or 2-D slots and a strided or read-only table: refused, nothing read past.
    read_only = np.ones(8, dtype=np.int32)
    read_only.flags.writeable = False
    for queue, table in (
        ([np.arange(8)[::2]], held),
        ([np.arange(8).reshape(2, 4)], held),
        ([np.array([1])], held[::2]),
        ([np.array([1])], read_only),
    ):
        with pytest.raises(ValueError, match=r"contiguous|1-D buffer|read-only"):
            CORE.drain(queue, table)
        assert len(queue) == 1 and held.all() and read_only.all()


def test_flush_frees_the_same_slots_on_both_paths() -> None:
    """An evict of several leaves and a cut tail reaches the allocator as one free of the
    same slots, in the same order, compiled or not; the held flags end the same."""
    seen = []
    for off in PATHS:
        kit = make_tree(python_paths=off, size=64)
        kit.tree.check_slots = True
        for key in ([1, 2, 3], [4, 5], [1, 2, 6, 7]):
            kit.put(key)
        freed: list[list[int]] = []
        allocator: Any = kit.tree._full.allocator
        free = allocator.free

        def spy(t: Any, _free: Any = free, _freed: list[list[int]] = freed) -> None:
            _freed.append(t.tolist())
            _free(t)

        allocator.free = spy
        kit.tree.evict(EvictRequest.full(4))
        held = kit.tree._full.held
        assert held is not None
        seen.append((freed, np.flatnonzero(held).tolist()))
        kit.check()
    assert all(s == seen[0] for s in seen)
    assert len(seen[0][0]) == 1


class _FailingFree:
    """A stand-in slot sink (no `check_allocated`) whose `free` raises while `fail` is set."""

    device = "cpu"
    size = 1 << 20

    def __init__(self) -> None:
        self.fail = False

    def available_size(self) -> int:
        return self.size

    def free(self, indices: Any, /) -> None:
        if self.fail:
            raise RuntimeError("free refused")


def test_a_free_that_raises_leaves_the_same_held_flags_on_both_paths() -> None:
    """Full's flush hands the queued slots to the allocator; when that `free` raises, both
    paths leave the queue empty and the held flags of the gone slots cleared (the nodes left
    the tree), so a later insert of those slots gets the same answer compiled or not."""
    seen = []
    for off in PATHS:
        sink = _FailingFree()
        with disabled() if off else nullcontext():
            tree = UnifiedRadixCache([FullComponent(sink)], page_size=1)  # pyright: ignore[reportArgumentType]
        tree.insert(RadixKey([1, 2, 3]), np.array([5, 6, 7]))
        sink.fail = True
        with pytest.raises(RuntimeError, match="free refused"):
            tree.evict(EvictRequest.full(3))
        held = tree._full.held
        assert held is not None
        flags = np.flatnonzero(held).tolist()
        sink.fail = False
        again = tree.insert(RadixKey([9, 9, 9]), np.array([5, 6, 7]))
        seen.append((flags, tree._full._pending, again.inserted_len, tree.num_nodes))
    assert all(s == seen[0] for s in seen)
    assert seen[0] == ([], [], 3, 1)


@pytest.mark.parametrize("checked", [False, True])
def test_a_cached_len_inside_the_unaligned_tail_is_taken_on_both_paths(checked: bool) -> None:
    """`cached_len` may reach into the key's unaligned tail (0 <= cached_len <= len(key)):
    the tree stores the whole pages only, so the check covers nothing past them and the tail
    slots stay the caller's (not marked held): the compiled check raised ValueError for the
    empty range [6, 4), and the Python path marked the two tail slots held for good."""
    seen = []
    for off in PATHS:
        with disabled() if off else nullcontext():
            if checked:  # an allocator with check_allocated
                kit = make_tree(size=64, page_size=4)
                tree, pages = kit.tree, kit.alloc(8).numpy()
            else:  # a stand-in sink: the compiled check is the whole check
                tree = UnifiedRadixCache([FullComponent(SlotCounter())], page_size=4)
                pages = np.arange(10, 18, dtype=np.int64)
        result = tree.insert(RadixKey(list(range(6))), pages[:6], cached_len=6)
        held = tree._full.held
        assert held is not None
        flags = np.flatnonzero(held).tolist()
        # The tail slots are not the tree's: another key may bring them.
        other = tree.insert(RadixKey([7, 7, 7, 7]), pages[4:])
        seen.append((result.prefix_len, result.inserted_len, flags, other.inserted_len))
    assert all(s == seen[0] for s in seen[1:])
    assert seen[0][:2] == (0, 4) and len(seen[0][2]) == 4


@needs_core
def test_a_full_component_subclass_keeps_its_own_take_pending() -> None:
    """Only an exact `FullComponent` gets the compiled `drain`: a subclass's `take_pending`
    still decides what its `flush` frees."""

    class Recording(FullComponent):
        def __init__(self, allocator: Any) -> None:
            super().__init__(allocator)
            self.taken = 0

        def take_pending(self) -> Any:
            self.taken += 1
            return super().take_pending()

    allocator = make_full_allocator(size=64, page_size=1)
    full = Recording(allocator)
    tree = _tree(full)
    assert full.drain is None
    tree.insert(RadixKey([1, 2, 3, 4]), allocator.alloc(4))
    tree.evict(EvictRequest.full(4))
    assert full.taken == 1
    tree.check_integrity()
