"""The compiled insert of a Full-only tree with a host tier (`insert_tiered` in radix_insert.c,
taken by `HostWalks.insert_full`) gives the Python walk's answers: a Hypothesis state machine
runs the same inserts (random prompts, partial pages, keys over off-device nodes that revive,
a caller's locked prefix as `cached_len`), locks, device and host evictions on a hierarchy
built with the compiled core and on one built inside `native.disabled()`, and requires the
same results (or the same exception), the same tiers and `check_integrity` on both after
every step. Plus: the compiled call really served (revives included), the cases it hands back
to the Python walk, its refusals of bad input, and only the exact classes take it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.pool import native
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, tiers_picture
from kvstrata.unified_radix_cache import FullComponent, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.errors import InvalidInsert
from kvstrata.unified_radix_cache.native_core import RadixCore, native_core
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode
from kvstrata.unified_radix_cache.results import LockReceipt

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")

P = 4
#: 1 to 4 pages over a small alphabet (shared prefixes, splits) plus 0 to P - 1 tokens of a
#: partial page the tree does not store.
PROMPT = st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=4), st.integers(0, P - 1)).map(
    lambda t: [x for p in t[0] for x in [p] * P] + [7] * t[1]
)


class _Served:
    """A compiled core whose `insert_tiered` counts the inserts it served (not handed back)
    and those that revived off-device nodes."""

    def __init__(self, core: RadixCore) -> None:
        self._core = core
        self.served = 0
        self.revived = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def insert_tiered(self, *args: Any) -> Any:
        out = self._core.insert_tiered(*args)
        if out is not None:
            self.served += 1
            self.revived += bool(out[3])
        return out


def _spied(h: Hierarchy) -> _Served:
    """Counts the compiled inserts `h`'s tree makes from now on."""
    assert CORE is not None
    spy = _Served(CORE)
    core: Any = spy  # the compiled core's functions, through the counter
    h.tree._native = core
    return spy


def _twin(policy: str, check: bool, events: bool) -> Hierarchy:
    return make_hierarchy(
        "full",
        page_size=P,
        device_pages=8,
        host_pages=16,
        enable_events=events,
        tree=lambda system: UnifiedRadixCache(
            [FullComponent(system.kv_allocator)],
            page_size=P,
            eviction_policy=policy,
            check_slots=check,
            enable_events=events,
        ),
    )


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except InvalidInsert as e:
        return (type(e).__name__, str(e))


@needs_core
class TieredInsertMatchesPython(RuleBasedStateMachine):
    """The same operations on a compiled-core hierarchy and a pure-Python one."""

    def __init__(self) -> None:
        super().__init__()
        self.twins: tuple[Hierarchy, Hierarchy] | None = None
        self.receipts: list[tuple[LockReceipt, LockReceipt]] = []

    @initialize(
        policy=st.sampled_from(["lru", "priority"]), check=st.booleans(), events=st.booleans()
    )
    def build(self, policy: str, check: bool, events: bool) -> None:
        fast = _twin(policy, check, events)
        with native.disabled():
            slow = _twin(policy, check, events)
        assert fast.tree._native is not None and slow.tree._native is None
        self.twins = (fast, slow)

    def teardown(self) -> None:
        if self.twins is not None:
            for h in self.twins:
                h.cache.controller.close()

    def _both(self, op: Callable[[Hierarchy], object]) -> object:
        assert self.twins is not None
        got = [_outcome(lambda h=h: op(h)) for h in self.twins]
        assert got[0] == got[1]
        for h in self.twins:
            h.cache.drain()  # both commit the same transfers before the next step
        return got[0]

    @precondition(lambda self: self.twins is not None)
    @rule(tokens=PROMPT, priority=st.integers(0, 2), write=st.booleans())
    def insert(self, tokens: list[int], priority: int, write: bool) -> None:
        """Fresh slots for every token (allocate-or-evict), the duplicates and the unstored
        tail freed. `write`: through the cache (the write policy queues a host write), else
        the tree's own insert with `priority`."""

        def op(h: Hierarchy) -> object:
            page = h.tree.page_size
            pages = h.cache.alloc_tokens(-(-len(tokens) // page) * page)
            if pages is None:
                return "no room"
            slots = pages[: len(tokens)]
            key = RadixKey(tokens)
            if write:
                result = h.cache.insert(key, slots)
            else:
                result = h.tree.insert(key, slots, priority=priority)
            h.allocator.free(result.duplicates(slots))
            h.allocator.free(pages[result.prefix_len + result.inserted_len :])
            return (*result[:2], result.last_node.id, *result[3:])

        self._both(op)

    @precondition(lambda self: self.twins is not None)
    @rule(tokens=PROMPT, more=PROMPT)
    def insert_after_lock(self, tokens: list[int], more: list[int]) -> None:
        """A request's insert: match and lock `tokens`, allocate for `more` past the device
        hit, insert the whole key with the hit's slots as `cached_len` (a key running over
        off-device nodes inside it is refused, past it revived), unlock."""

        def op(h: Hierarchy) -> object:
            key = RadixKey(tokens + more)
            match = h.tree.match_prefix(RadixKey(tokens))
            receipt = h.tree.lock(match.last_node)
            try:
                hit = match.prefix_len
                page = h.tree.page_size
                pages = h.cache.alloc_tokens(-(-(len(key) - hit) // page) * page)
                if pages is None:
                    return "no room"
                value = torch.cat([match.device_indices, pages[: len(key) - hit]])
                try:
                    result = h.tree.insert(key, value, cached_len=hit)
                except InvalidInsert:
                    h.allocator.free(pages)
                    raise
                h.allocator.free(result.duplicates(value))
                kept = result.prefix_len + result.inserted_len
                h.allocator.free(pages[max(kept - hit, 0) :])
                return (*result[:2], result.last_node.id, *result[3:])
            finally:
                h.tree.unlock(receipt)

        self._both(op)

    @precondition(lambda self: self.twins is not None)
    @rule(tokens=PROMPT)
    def lock(self, tokens: list[int]) -> None:
        assert self.twins is not None
        fast, slow = self.twins
        key = RadixKey(tokens)
        pair = (
            fast.tree.lock(fast.tree.match_prefix(key).last_node),
            slow.tree.lock(slow.tree.match_prefix(key).last_node),
        )
        assert pair[0].anchor.id == pair[1].anchor.id
        self.receipts.append(pair)

    @precondition(lambda self: self.twins is not None and self.receipts)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        assert self.twins is not None
        pair = self.receipts.pop(data.draw(st.integers(0, len(self.receipts) - 1)))
        for h, receipt in zip(self.twins, pair, strict=True):
            h.tree.unlock(receipt)

    @precondition(lambda self: self.twins is not None)
    @rule(amount=st.integers(1, 24))
    def evict_device(self, amount: int) -> None:
        """Device leaves go: with a host copy they stay in the tree off the device."""
        self._both(lambda h: h.cache.evict_device(amount))

    @precondition(lambda self: self.twins is not None)
    @rule(amount=st.integers(1, 24))
    def evict_host(self, amount: int) -> None:
        self._both(lambda h: h.cache.evict_host(amount))

    @invariant()
    def same_tiers(self) -> None:
        if self.twins is None:
            return
        fast, slow = self.twins
        fast.cache.check_integrity()
        slow.cache.check_integrity()
        assert tiers_picture(fast) == tiers_picture(slow)
        assert fast.tree.num_nodes == slow.tree.num_nodes
        assert fast.allocator.available_size() == slow.allocator.available_size()
        assert fast.cache.take_events() == slow.cache.take_events()


TieredInsertMatchesPython.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestTieredInsertMatchesPython = needs_core(TieredInsertMatchesPython.TestCase)


@pytest.fixture
def fast(closing: list[Hierarchy]) -> tuple[Hierarchy, _Served]:
    """A compiled-core Full-only hierarchy (page 4, device 8 pages, host 16) whose
    `insert_tiered` is counted."""
    assert CORE is not None
    h = _twin("lru", True, False)
    closing.append(h)
    spy = _spied(h)
    return h, spy


def _fresh(h: Hierarchy, tokens: list[int]) -> torch.Tensor:
    slots = h.cache.alloc_tokens(len(tokens))
    assert slots is not None
    return slots


@needs_core
def test_the_compiled_insert_serves_inserts_and_revives(fast: tuple[Hierarchy, _Served]) -> None:
    h, spy = fast
    tokens = [1] * P + [2] * P
    slots = _fresh(h, tokens)
    assert h.cache.insert(RadixKey(tokens), slots).inserted_len == 2 * P
    h.cache.drain()
    assert h.cache.evict_device(2 * P) == 2 * P  # both pages off the device, kept on the host
    again = _fresh(h, tokens)
    result = h.tree.insert(RadixKey(tokens), again)
    assert (result.prefix_len, result.inserted_len, result.adopted) == (2 * P, 0, ((0, 2 * P),))
    assert torch.equal(result.duplicates(again), again[:0])
    assert (spy.served, spy.revived) == (2, 1)
    h.cache.check_integrity()


@needs_core
def test_a_revive_inside_the_cached_prefix_goes_to_the_python_walk(
    fast: tuple[Hierarchy, _Served],
) -> None:
    """Off-device nodes inside the caller's `cached_len`: the compiled call changes nothing
    and the Python walk refuses with its message."""
    h, spy = fast
    tokens = [1] * P + [2] * P
    h.cache.insert(RadixKey(tokens), _fresh(h, tokens))
    h.cache.drain()
    h.cache.evict_device(2 * P)
    value = _fresh(h, tokens)
    with pytest.raises(InvalidInsert, match="cached_len 4 reaches past the device prefix"):
        h.tree.insert(RadixKey(tokens), value, cached_len=P)
    assert spy.served == 1
    h.allocator.free(value)
    h.cache.check_integrity()


@needs_core
@pytest.mark.parametrize(
    ("first", "cached_len", "served"),
    [
        (0, 4, 0),  # cached_len past the held prefix (nothing held): the Python walk
        (0, 9, 0),  # cached_len inside the unaligned tail, past every stored page
        (2, 0, 2),  # a revive of both pages, nothing cached: compiled (as the first insert)
    ],
)
def test_the_cases_handed_back_end_as_on_the_python_path(
    closing: list[Hierarchy], first: int, cached_len: int, served: int
) -> None:
    """Twin hierarchies: `first` pages of the key inserted, sent off the device, then the
    whole key (2 pages and a partial one) inserted with `cached_len`: the same result and
    tiers, whichever path served."""
    assert CORE is not None
    made = [_twin("lru", True, False)]
    with native.disabled():
        made.append(_twin("lru", True, False))
    closing.extend(made)
    spy = _spied(made[0])
    tokens = [1] * P + [2] * P + [7]
    got = []
    for h in made:
        if first:
            h.cache.insert(RadixKey(tokens[: first * P]), _fresh(h, tokens[: first * P]))
            h.cache.drain()
            h.cache.evict_device(first * P)
        pages = _fresh(h, [0] * 3 * P)
        result = h.tree.insert(RadixKey(tokens), pages[: len(tokens)], cached_len=cached_len)
        got.append((*result[:2], result.last_node.id, *result[3:]))
        h.allocator.free(result.duplicates(pages[: len(tokens)]))
        h.allocator.free(pages[result.prefix_len + result.inserted_len :])
    assert got[0] == got[1]
    assert tiers_picture(made[0]) == tiers_picture(made[1])
    assert spy.served == served
    for h in made:
        h.cache.check_integrity({"full": 0})


@needs_core
def test_events_keep_the_python_walk(closing: list[Hierarchy]) -> None:
    assert CORE is not None
    h = _twin("lru", True, True)
    closing.append(h)
    spy = _spied(h)
    tokens = [1] * P
    assert h.cache.insert(RadixKey(tokens), _fresh(h, tokens)).inserted_len == P
    assert spy.served == 0 and h.cache.take_events()
    h.cache.check_integrity()


class _SubTree(UnifiedRadixCache):
    pass


@needs_core
@pytest.mark.parametrize(("tree_cls", "served"), [(UnifiedRadixCache, 1), (_SubTree, 0)])
def test_only_the_exact_classes_take_the_compiled_insert(
    full_hierarchy_of: Callable[[type[UnifiedRadixCache], type[FullComponent]], Hierarchy],
    tree_cls: type[UnifiedRadixCache],
    served: int,
) -> None:
    assert CORE is not None
    h = full_hierarchy_of(tree_cls, FullComponent)
    spy = _spied(h)
    tokens = [1] * P
    h.cache.insert(RadixKey(tokens), _fresh(h, tokens))
    assert spy.served == served
    h.cache.check_integrity()


@needs_core
def test_the_compiled_insert_refuses_bad_input_with_an_exception(
    fast: tuple[Hierarchy, _Served],
) -> None:
    assert CORE is not None
    h, _ = fast
    tree = h.tree
    tier = tree.host_tier
    assert tier is not None
    full = tree.components[0]
    assert isinstance(full, FullComponent)
    heap = full.heap
    data = RadixKey([1] * P).token_bytes()
    slots = _fresh(h, [1] * P).numpy()

    core: Any = CORE  # called with wrong arguments on purpose

    def call(*changed: tuple[int, object]) -> object:
        args: list[object] = [tree, heap, None, None, TreeNode, NO_CHILDREN, None, data]
        args += [len(data), slots, 0, 0]
        for at, value in changed:
            args[at] = value
        return core.insert_tiered(*args)

    with pytest.raises(TypeError):
        core.insert_tiered(tree, heap)
    with pytest.raises(TypeError, match="priority"):
        call((11, "high"))
    with pytest.raises(TypeError, match="bytes"):
        call((7, bytearray(data)))
    for end in (len(data) + 8 * P, 8, -8 * P):  # past the data, not a whole page, negative
        with pytest.raises(ValueError):
            call((8, end))
    with pytest.raises(AttributeError):
        call((0, object()))
    assert tree.num_nodes == 0
    h.allocator.free(torch.from_numpy(slots))
    h.cache.check_integrity()
