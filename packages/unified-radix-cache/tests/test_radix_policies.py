"""The ordered structures behind eviction: LeafHeap (lazy invalidation) and LRUList."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import (
    POLICIES,
    LeafHeap,
    LRUList,
    LRUPolicy,
    make_policy,
)


def _node(node_id: int, tick: int) -> TreeNode:
    return TreeNode(node_id, b"\0" * 8, np.zeros(1, dtype=np.int64), None, None, tick, 1)


def test_make_policy_knows_the_six_policies() -> None:
    assert set(POLICIES) == {"lru", "lfu", "fifo", "mru", "filo", "priority"}
    with pytest.raises(InvalidConfig):
        make_policy("random")


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "discard", "pop", "peek_pop"]),
            st.integers(0, 9),
            st.integers(0, 50),
        ),
        max_size=80,
    )
)
def test_leaf_heap_matches_a_sorted_model(ops: list[tuple[str, int, int]]) -> None:
    heap = LeafHeap(LRUPolicy())
    nodes = [_node(i, 0) for i in range(10)]
    model: dict[int, int] = {}
    for op, i, tick in ops:
        node = nodes[i]
        if op == "push":
            node.last_access = tick
            heap.push(node)
            model[i] = tick
        elif op == "discard":
            heap.discard(node)
            model.pop(i, None)
        else:
            if op == "pop":
                got = heap.pop()
            else:
                got = heap.peek()
                if got is not None:
                    heap.pop_peeked(got)
            if not model:
                assert got is None
            else:
                want = min(model, key=lambda k: (model[k], k))
                assert got is nodes[want]
                del model[want]
        assert len(heap) == len(model)
        heap.check_integrity()


def test_leaf_heap_compacts_stale_entries() -> None:
    heap = LeafHeap(LRUPolicy())
    node = _node(1, 0)
    for tick in range(5000):
        node.last_access = tick
        heap.push(node)
    assert len(heap._heap) < 2100  # rebuilt instead of growing with every re-key
    assert heap.pop() is node and heap.pop() is None


def test_lru_list_order_touch_and_insert_before() -> None:
    lru = LRUList()
    a, b, c, d = (_node(i, 0) for i in range(4))
    for n in (a, b, c):
        lru.touch(n)
    lru.touch(a)
    assert lru.nodes() == [b, c, a]
    lru.insert_before(d, c)
    assert lru.nodes() == [b, d, c, a]
    lru.discard(c)
    assert lru.pop_lru() is b and lru.pop_lru() is d and lru.pop_lru() is a
    assert lru.pop_lru() is None and len(lru) == 0


@given(
    st.lists(st.integers(1, 4), min_size=0, max_size=8),
    st.integers(0, 40),
    st.sampled_from([1, 2, 4]),
)
def test_leaf_heap_victims_take_whole_leaves_then_a_tail(
    pages: list[int], amount: int, page: int
) -> None:
    """`victims(amount, page)`: leaves in heap order, whole while they fit, then the first
    that does not keeps its head (whole pages) and ends the run; taking each whole one out of
    the heap is the caller's part."""
    heap = LeafHeap(LRUPolicy())
    nodes = []
    for i, n in enumerate(pages):
        node = TreeNode(
            i, b"\0" * 8 * n * page, np.zeros(n * page, dtype=np.int64), None, None, i, 1
        )
        heap.push(node)
        nodes.append(node)
    got: list[tuple[int, int]] = []
    for node, keep in heap.victims(amount, page):
        got.append((node.id, keep))
        if keep <= 0:
            heap.pop_peeked(node)
    want: list[tuple[int, int]] = []
    freed = 0
    for node in nodes:
        if freed >= amount:
            break
        size = len(node.value)
        need = -(-(amount - freed) // page) * page  # what is left, rounded up to whole pages
        want.append((node.id, size - need))
        if size > need:
            break
        freed += size
    assert got == want
    for node_id, keep in got:
        assert keep <= 0 or (keep % page == 0 and 0 < keep < len(nodes[node_id].value))
    assert len(heap) == len(nodes) - sum(1 for _, keep in got if keep <= 0)
    heap.check_integrity()
