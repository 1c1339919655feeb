"""The compiled walks, slot check and Full eviction loop (`radix_core.c`, native_core.py) give
the same answers as the Python paths: a Hypothesis state machine runs every operation on a tree
with the compiled core and on one made inside `native.disabled()` and compares results and the
whole tree (nodes, slots, access times, hit counts, locks, heap entries, sizes) after every
step, with `check_integrity` on both. Plus the compiled functions' refusals of bad input (an
exception, never a crash) and the insert-after-match walk reuse on the compiled path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.testkit.refusals import tree_state
from kvstrata.testkit.trees import TreeKit, make_tree
from kvstrata.unified_radix_cache import EvictRequest, LockReceipt, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.errors import (
    DuplicateSlot,
    SlotInTree,
    SlotNotAllocated,
    SlotOutOfRange,
)
from kvstrata.unified_radix_cache.native_core import native_core
from kvstrata.unified_radix_cache.node import TreeNode

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=14)
NAMESPACES = st.sampled_from([None, "lora"])


def picture(tree: UnifiedRadixCache) -> tuple[object, ...]:
    """Everything the operations change: every node field, sizes, heap entries, pools (the
    testkit's `tree_state`, less its metrics: they include evict seconds), the node count and
    the query counters."""
    counters = (tree.num_nodes, tree.queried_tokens, tree.hit_tokens, tree.inserted_tokens)
    return (dataclasses.replace(tree_state(tree), metrics=()), counters)


@needs_core
class NativeMatchesPython(RuleBasedStateMachine):
    """The same operations on a compiled-core tree and a pure-Python one."""

    def __init__(self) -> None:
        super().__init__()
        self.kits: tuple[TreeKit, TreeKit] | None = None
        self.receipts: list[tuple[LockReceipt, LockReceipt]] = []

    @rule(
        page=st.sampled_from([1, 4]),
        policy=st.sampled_from(["lru", "lfu", "priority"]),
        check=st.booleans(),
        events=st.booleans(),
    )
    @precondition(lambda self: self.kits is None)
    def build(self, page: int, policy: str, check: bool, events: bool) -> None:
        fast, slow = (
            make_tree(
                python_paths=off, size=256, page_size=page, policy=policy, enable_events=events
            )
            for off in (False, True)
        )
        fast.tree.check_slots = slow.tree.check_slots = check
        assert fast.tree._native is not None and slow.tree._native is None
        # Without events the compiled eviction loop runs; with them the Python one (events).
        assert (fast.tree._full.leaf_evictor is not None) is (not events)
        self.kits = (fast, slow)

    @rule(tokens=TOKENS, ns=NAMESPACES, priority=st.integers(0, 2))
    @precondition(lambda self: self.kits is not None)
    def insert(self, tokens: list[int], ns: str | None, priority: int) -> None:
        assert self.kits is not None
        fast, slow = self.kits
        if fast.full.available_size() < len(tokens) + 8:
            return
        a, sa = fast.put(tokens, extra_key=ns, priority=priority)
        b, sb = slow.put(tokens, extra_key=ns, priority=priority)
        assert torch.equal(sa, sb)
        assert (a.prefix_len, a.inserted_len, a.last_node.id) == (
            b.prefix_len,
            b.inserted_len,
            b.last_node.id,
        )

    @rule(tokens=TOKENS, ns=NAMESPACES, lock=st.booleans(), then_insert=st.booleans())
    @precondition(lambda self: self.kits is not None)
    def match(self, tokens: list[int], ns: str | None, lock: bool, then_insert: bool) -> None:
        assert self.kits is not None
        results = []
        for kit in self.kits:
            key = RadixKey(tokens, ns)
            m = kit.tree.match_prefix(key, max_len=len(tokens) - 1 if lock else None)
            results.append((m.prefix_len, m.device_indices.tolist(), m.last_node.id))
            if then_insert and kit.full.available_size() >= len(tokens) + 8:
                # The insert after its match reuses the match's walk.
                page = kit.tree.page_size
                slots = kit.alloc(-(-len(tokens) // page) * page)[: len(tokens)]
                got = kit.tree.insert(key, slots)
                kit.full.free(got.duplicates(slots))
                kept = got.prefix_len + got.inserted_len
                if kept < len(tokens):
                    kit.full.free(slots[kept:])
                results.append((got.prefix_len, got.inserted_len, got.last_node.id))
        half = len(results) // 2
        assert results[:half] == results[half:]
        if lock and results[0][2] != 0:
            fast, slow = self.kits
            pair = (
                fast.tree.lock(fast.tree.match_prefix(RadixKey(tokens, ns)).last_node),
                slow.tree.lock(slow.tree.match_prefix(RadixKey(tokens, ns)).last_node),
            )
            self.receipts.append(pair)

    @rule(data=st.data())
    @precondition(lambda self: self.kits is not None and self.receipts)
    def unlock(self, data: st.DataObject) -> None:
        assert self.kits is not None
        i = data.draw(st.integers(0, len(self.receipts) - 1))
        ra, rb = self.receipts.pop(i)
        self.kits[0].tree.unlock(ra)
        self.kits[1].tree.unlock(rb)

    @rule(amount=st.integers(0, 40))
    @precondition(lambda self: self.kits is not None)
    def evict(self, amount: int) -> None:
        assert self.kits is not None
        fast, slow = self.kits
        a = fast.tree.evict(EvictRequest.full(amount))
        b = slow.tree.evict(EvictRequest.full(amount))
        assert (a.evicted, a.nodes_removed) == (b.evicted, b.nodes_removed)
        assert fast.tree.take_events() == slow.tree.take_events()

    @invariant()
    def same_trees(self) -> None:
        if self.kits is None:
            return
        fast, slow = self.kits
        fast.check()
        slow.check()
        assert picture(fast.tree) == picture(slow.tree)
        assert fast.full.available_size() == slow.full.available_size()


NativeMatchesPython.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestNativeMatchesPython = needs_core(NativeMatchesPython.TestCase)


@needs_core
def test_insert_after_its_match_walks_once_on_the_compiled_path(
    counting: Callable[[object, list[str]], Any],
) -> None:
    kit = make_tree("full", page_size=4)
    kit.put(list(range(8)))
    assert CORE is not None
    calls: list[str] = []
    kit.tree._native = counting(CORE, calls)
    key = RadixKey([*range(4), 50, 51, 52, 53, 54, 55, 56, 57])
    assert kit.tree.match_prefix(key).prefix_len == 4  # splits [0..7] after 4
    slots = kit.alloc(12)
    result = kit.tree.insert(key, slots)
    assert [c for c in calls if c in ("walk", "match")] == ["match"]
    assert (result.prefix_len, result.inserted_len) == (4, 8)
    kit.full.free(result.duplicates(slots))
    assert kit.tree.insert(RadixKey(list(key.tokens())), slots).inserted_len == 0
    assert [c for c in calls if c in ("walk", "match")] == ["match", "walk"]
    kit.check()


@needs_core
@pytest.mark.parametrize(
    ("slots", "error"),
    [
        ([1, 2, 2, 3], DuplicateSlot),
        ([1, 2, 999_999, 3], SlotOutOfRange),
        ([1, 2, -5, 3], SlotOutOfRange),
        ([5, 6, 7, 8], SlotNotAllocated),  # never handed out by the allocator
    ],
)
def test_the_compiled_slot_check_refuses_what_the_python_one_refuses(
    slots: list[int], error: type[Exception]
) -> None:
    messages = []
    for off in (False, True):
        kit = make_tree(python_paths=off, size=64)
        kit.alloc(4)  # slots 1..4 handed out (slot 0 is reserved)
        before = picture(kit.tree)
        with pytest.raises(error) as caught:
            kit.tree.insert(RadixKey([9, 9, 9, 9]), torch.tensor(slots))
        assert picture(kit.tree) == before
        messages.append(str(caught.value))
        kit.check({"full": 4})
    assert messages[0] == messages[1]


@needs_core
def test_a_slot_held_by_the_tree_is_refused_on_both_paths() -> None:
    for off in (False, True):
        kit = make_tree(python_paths=off, size=64)
        _, slots = kit.put([1, 2, 3])
        with pytest.raises(SlotInTree):
            kit.tree.insert(RadixKey([7, 8, 9]), slots)
        kit.check()


@needs_core
def test_the_compiled_check_hands_strided_slots_to_the_python_check() -> None:
    assert CORE is not None
    held = np.zeros(64, dtype=np.int32)
    strided = np.arange(20, dtype=np.int64)[::2]
    assert CORE.check_slots(strided, 0, 5, held, True) is False
    assert not held.any()
    run = np.array([3, 9, 4], dtype=np.int64)
    assert CORE.check_slots(run, 0, 3, held, False) is True
    assert not held.any()  # without keep nothing stays marked
    assert CORE.check_slots(run, 0, 3, held, True) is True
    assert held[[3, 9, 4]].tolist() == [1, 1, 1]
    assert CORE.check_slots(np.array([5, 9], dtype=np.int64), 0, 2, held, True) is False
    assert held[5] == 0  # the refused call left nothing marked
    with pytest.raises(ValueError, match="outside"):
        CORE.check_slots(run, 0, 4, held, True)
    with pytest.raises(ValueError, match="4-byte"):
        CORE.check_slots(run, 0, 3, np.zeros(8, dtype=np.int64), True)


@needs_core
def test_the_compiled_functions_refuse_bad_input_with_an_exception() -> None:
    assert CORE is not None
    kit = make_tree("full", page_size=2)
    kit.put([1, 2, 3, 4])
    root = kit.tree.root
    data = RadixKey([1, 2, 3, 4]).token_bytes()
    with pytest.raises(TypeError):
        CORE.walk(root, 16, None, bytearray(data), 32, None)  # pyright: ignore[reportArgumentType]
    for end in (48, 8, -16):  # past the data, not a whole page, negative
        with pytest.raises(ValueError):
            CORE.walk(root, 16, None, data, end, None)
    with pytest.raises(TypeError):
        CORE.walk(root, 16, None, data, 32)  # pyright: ignore[reportCallIssue]
    assert CORE.walk(root, 16, None, data, 0, None) == ([], 0, 0)
    with pytest.raises(AttributeError):
        CORE.walk(object(), 16, None, data, 32, None)  # pyright: ignore[reportArgumentType]
    (leaf,) = kit.tree.iter_nodes()
    good_key = leaf.key
    leaf.key = "not bytes"  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError, match="bytes"):
        CORE.walk(root, 16, None, data, 32, None)
    leaf.key = good_key
    good_value = leaf.value
    leaf.value = good_value[:1]
    with pytest.raises(ValueError, match="node value"):
        CORE.match(root, 16, None, data, 32, None, 5)  # pyright: ignore[reportArgumentType]
    leaf.value = good_value
    with pytest.raises(AttributeError):
        CORE.evict(object(), 4, 2, 16, root, {}, [], None, None, bytearray(16), False)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="page"):
        CORE.evict(kit.tree._heap, 4, 2, 8, root, {}, [], None, None, bytearray(16), False)
    kit.check()


@needs_core
def test_a_compiled_split_in_the_walk_matches_the_python_one() -> None:
    """`walk(.., split)` splits where the match ends inside a node, as `descend` does."""
    pictures = []
    for off in (False, True):
        kit = make_tree(python_paths=off, page_size=2)
        kit.put([1, 2, 3, 4, 5, 6])
        path = kit.tree.walk(None, RadixKey([1, 2, 3, 4, 9, 9]).token_bytes(), 48)
        assert [n.num_tokens for n in path] == [4]
        assert isinstance(path[0], TreeNode)
        pictures.append(picture(kit.tree))
        kit.check()
    assert pictures[0] == pictures[1]
