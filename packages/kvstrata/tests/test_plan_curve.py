"""The one-pass LRU curve against direct replays: a reference page LRU written here (every
capacity) and kvstrata's own radix tree (capacities from the longest request up)."""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.plan import (
    BlockTrace,
    HitCurve,
    PlanOptionError,
    TraceNotChained,
    lru_curve,
    read_block_trace,
)
from kvstrata.replay import TraceFormatError
from kvstrata.testkit import WORKSPACE_ROOT
from kvstrata.testkit.trees import lru_prefix_hits

SHARED_TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


class LeafFirstLRU:
    """The reference: a page LRU that ranks a request's pages root first (touches them deepest
    first), so the root of a request is the most recent of its pages. The hit is the longest
    cached prefix; the test also checks every cached page of the request is in that prefix."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, None] = OrderedDict()  # least recent first

    def step(self, chain: list[int]) -> int:
        hit = 0
        while hit < len(chain) and chain[hit] in self.pages:
            hit += 1
        assert sum(p in self.pages for p in chain) == hit, "cached pages are prefix-closed"
        for page in reversed(chain):
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return hit


class RootFirstPageLRU:
    """A plain page LRU touching the pages in prompt order (root least recent), counting every
    cached page as a hit: what a per-page cache would do, not a prefix cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, None] = OrderedDict()

    def step(self, chain: list[int]) -> int:
        hit = sum(p in self.pages for p in chain)
        for page in chain:
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return hit


def reference_hits(chains: list[list[int]], capacity: int) -> int:
    cache = LeafFirstLRU(capacity)
    return sum(cache.step(chain) for chain in chains)


def tree_hits(chains: list[list[int]], capacity: int, *, page_size: int = 1) -> int:
    """Block hits of kvstrata's UnifiedRadixCache (LRU) driven as `bench radix` drives it
    (`lru_prefix_hits`), never holding more than `capacity` blocks."""
    t = page_size
    keys = (array("q", [b * t + j for b in chain for j in range(t)]) for chain in chains)
    return lru_prefix_hits(keys, page_size=t, capacity_tokens=capacity * t) // t


@st.composite
def chained_traces(draw: st.DrawFn) -> list[list[int]]:
    """Requests that extend a prefix of an earlier request (or start afresh) with new blocks;
    ids are then renamed by a random injective map, as hash ids are arbitrary."""
    chains: list[list[int]] = []
    next_id = 0
    for _ in range(draw(st.integers(1, 24))):
        prefix: list[int] = []
        if chains and draw(st.integers(0, 3)) > 0:
            base = draw(st.sampled_from(chains))
            prefix = base[: draw(st.integers(1, len(base)))]
        extra = draw(st.integers(0 if prefix else 1, 5))
        chains.append(prefix + list(range(next_id, next_id + extra)))
        next_id += extra
    names = draw(st.lists(st.integers(0, 2**40), min_size=next_id, max_size=next_id, unique=True))
    return [[names[b] for b in chain] for chain in chains]


# ---------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------
def test_hand_computed_distances() -> None:
    # Stack after [0 1 2]: 0 1 2. [0 1 3] hits 0 at distance 0, 1 at 1 -> 0 1 3 2.
    # [0 1 2] hits 0 at 0, 1 at 1, 2 at 3.
    curve = lru_curve(BlockTrace.from_chains([[0, 1, 2], [0, 1, 3], [0, 1, 2]]))
    assert curve.hits.tolist() == [0, 2, 4, 4, 5]
    assert (curve.num_requests, curve.num_references, curve.num_distinct) == (3, 9, 4)
    assert curve.max_request_blocks == 3
    curve.check_integrity()


def test_a_request_drawing_on_two_earlier_ones() -> None:
    # The third request takes block 0 from request 1 and block 1 from request 0: the second
    # run's pages rank below the first run's, which the third request touches first.
    chains = [[0, 1], [0, 2], [0, 1]]
    curve = lru_curve(BlockTrace.from_chains(chains))
    assert [curve.hit_blocks(c) for c in range(4)] == [reference_hits(chains, c) for c in range(4)]
    assert curve.hits.tolist() == [0, 2, 2, 3]


@given(chained_traces())
def test_curve_equals_reference_lru_at_every_capacity(chains: list[list[int]]) -> None:
    curve = lru_curve(BlockTrace.from_chains(chains))
    curve.check_integrity()
    for capacity in range(curve.num_distinct + 2):
        assert curve.hit_blocks(capacity) == reference_hits(chains, capacity), capacity


@given(chained_traces(), st.sampled_from([1, 4]))
def test_curve_equals_the_tree_from_the_longest_request_up(
    chains: list[list[int]], page_size: int
) -> None:
    curve = lru_curve(BlockTrace.from_chains(chains))
    longest = curve.max_request_blocks
    for capacity in sorted({longest, longest + 1, (longest + curve.num_distinct) // 2}):
        assert curve.hit_blocks(capacity) == tree_hits(chains, capacity, page_size=page_size)


@given(chained_traces())
def test_leaf_first_lru_has_the_inclusion_property(chains: list[list[int]]) -> None:
    # After every request, the cache of c blocks is a subset of the cache of c + 1 blocks and
    # is prefix-closed (a parent stays while any child does): what Mattson's algorithm needs.
    distinct = len({b for chain in chains for b in chain})
    caches = [LeafFirstLRU(c) for c in range(distinct + 1)]
    parent = {chain[i]: chain[i - 1] for chain in chains for i in range(1, len(chain))}
    for chain in chains:
        for cache in caches:
            cache.step(chain)
        for smaller, larger in pairwise(caches):
            assert set(smaller.pages) <= set(larger.pages)
        for cache in caches:
            assert all(parent[p] in cache.pages for p in cache.pages if p in parent)


def test_root_first_page_lru_is_not_the_prefix_cache() -> None:
    # Capacity 2: [a b] then [c]. Root first, a is least recent and goes, stranding b; the
    # prefix cache (the tree, leaf first) drops the leaf b and keeps a for the next [a].
    a, b, c = 10, 11, 12
    chains = [[a, b], [c], [a]]
    root_first = RootFirstPageLRU(2)
    assert sum(root_first.step(chain) for chain in chains) == 0
    assert reference_hits(chains, 2) == 1
    assert tree_hits(chains, 2) == 1
    assert lru_curve(BlockTrace.from_chains(chains)).hit_blocks(2) == 1


def test_below_the_longest_request_the_curve_is_the_page_lru() -> None:
    # A tree cannot run a request longer than itself; the curve's figure there is the page
    # LRU's, and block 0 (opening every request) is all it keeps at capacity 1.
    chains = [[0, 1, 2], [0, 3, 4], [0, 1]]
    curve = lru_curve(BlockTrace.from_chains(chains))
    assert curve.hit_blocks(1) == reference_hits(chains, 1) == 2


# ---------------------------------------------------------------------------------------------
# Queries
# ---------------------------------------------------------------------------------------------
def test_queries() -> None:
    curve = lru_curve(BlockTrace.from_chains([[0, 1, 2], [0, 1, 3], [0, 1, 2]]))
    assert curve.hit_rate(2) == 4 / 9
    assert curve.hit_blocks(10**9) == 5 and curve.ideal_hit_rate == 5 / 9
    assert curve.hit_rates([0, 1, 4, 100]).tolist() == [0.0, 2 / 9, 5 / 9, 5 / 9]
    assert curve.min_capacity(0.0) == 0
    assert curve.min_capacity(4 / 9) == 2
    assert curve.min_capacity(4.5 / 9) == 4
    assert curve.min_capacity(5 / 9) == 4
    assert curve.min_capacity(0.6) is None


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.hit_blocks(-1),
        lambda c: c.hit_rate(-5),
        lambda c: c.hit_rates([3, -1]),
        lambda c: c.min_capacity(-0.1),
        lambda c: c.min_capacity(1.5),
    ],
)
def test_bad_queries_are_refused(call: object) -> None:
    curve = lru_curve(BlockTrace.from_chains([[0, 1]]))
    assert callable(call)
    with pytest.raises(PlanOptionError):
        call(curve)


def test_check_integrity_catches_a_broken_curve() -> None:
    good = lru_curve(BlockTrace.from_chains([[0, 1], [0, 1]]))
    broken = HitCurve(
        hits=np.array([0, 2, 1], dtype=np.int64),
        num_requests=good.num_requests,
        num_references=good.num_references,
        num_distinct=good.num_distinct,
        max_request_blocks=good.max_request_blocks,
    )
    good.check_integrity()
    with pytest.raises(AssertionError, match="never hurts"):
        broken.check_integrity()


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------
def test_dense_renaming_keeps_the_chains() -> None:
    trace = BlockTrace.from_chains([[70, 9], [70, 5, 8]])
    assert trace.chains() == [[0, 1], [0, 2, 3]]
    assert (trace.num_requests, trace.num_references, trace.num_distinct) == (2, 5, 4)


@pytest.mark.parametrize(
    ("chains", "block", "requests"),
    [
        ([[1, 2], [3, 2]], 2, (0, 1)),  # block 2 follows 1, then 3
        ([[1, 2], [2]], 2, (0, 1)),  # block 2 follows 1, then opens a request
        ([[5, 5]], 5, (0, 0)),  # a block twice in one request
        ([[0, 1], [0, 2], [4, 0]], 0, (0, 2)),
    ],
)
def test_unchained_trace_is_refused(
    chains: list[list[int]], block: int, requests: tuple[int, int]
) -> None:
    with pytest.raises(TraceNotChained) as info:
        BlockTrace.from_chains(chains)
    assert info.value.block_id == block
    assert (info.value.first_request, info.value.second_request) == requests
    assert f"block id {block}" in str(info.value)


@pytest.mark.parametrize(
    ("chains", "message"),
    [([], "no requests"), ([[0], []], "request 1 has no blocks"), ([[0, -3]], "non-negative")],
)
def test_bad_chains_are_refused(chains: list[list[int]], message: str) -> None:
    with pytest.raises(PlanOptionError, match=message):
        BlockTrace.from_chains(chains)


def test_read_block_trace_uses_the_replay_reader(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [{"hash_ids": [7, 8]}, {"timestamp": 3, "hash_ids": [7, 9]}, {"hash_ids": [7]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    assert read_block_trace(path).chains() == [[0, 1], [0, 2], [0]]
    assert read_block_trace(path, limit=2).num_requests == 2
    path.write_text('{"hash_ids": [1]}\n{"hash_ids": "x"}\n', encoding="utf-8")
    with pytest.raises(TraceFormatError, match=":2:"):
        read_block_trace(path)


# ---------------------------------------------------------------------------------------------
# The shared trace
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"no shared trace at {SHARED_TRACE}")
def test_shared_trace_reproduces_the_readme_figures() -> None:
    # shared/traces/README.md: leaf-first LRU 4.45 / 21.16 / 36.37 % at 1k / 10k / 100k
    # blocks, ideal 36.64 %, 288,500 references, 182,790 distinct blocks.
    trace = read_block_trace(SHARED_TRACE)
    curve = lru_curve(trace)
    curve.check_integrity()
    assert (curve.num_references, curve.num_distinct) == (288_500, 182_790)
    figures = [round(100 * curve.hit_rate(c), 2) for c in (1_000, 10_000, 100_000)]
    assert figures == [4.45, 21.16, 36.37]
    assert round(100 * curve.ideal_hit_rate, 2) == 36.64
    # And a direct replay of the tree on the first 3,000 requests, exact at two capacities.
    head = lru_curve(BlockTrace.from_chains(trace.chains()[:3000]))
    for capacity in (1_000, 10_000):
        assert head.hit_blocks(capacity) == tree_hits(trace.chains()[:3000], capacity)
