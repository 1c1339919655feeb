"""The one-frame evictions of `host_evict.py` against `HostTier`'s per-node loops they replace
(`_evict_device_each`, `_evict_each`): twin hierarchies served the same requests, small enough
that the device evicts and the host evicts (writes and load-backs make host room), must end
every request in the same state, and the one-frame loops must really be the ones that ran.
A tree, Full component or host tier of a subclass keeps its overrides: the per-node loops,
which call them, serve it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import pytest

from kvstrata.pool import native
from kvstrata.testkit.refusals import tree_state
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, returning_prompts, serve
from kvstrata.testkit.trees import make_full_allocator
from kvstrata.unified_radix_cache import FullComponent, HostTier, UnifiedRadixCache
from kvstrata.unified_radix_cache import host_tier as host_tier_module
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap

P = 4


def _requests() -> list[list[int]]:
    """`returning_prompts`: more than the device or the host holds, some coming back."""
    return returning_prompts(P)


@pytest.fixture(params=["compiled", "python"])
def walks(request: pytest.FixtureRequest) -> Iterator[str]:
    """With the tree's compiled core, then without it (hierarchies made inside
    `native.disabled()`, as CI's KVSTRATA_NATIVE=0 run)."""
    with nullcontext() if request.param == "compiled" else native.disabled():
        yield request.param


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tokens freed by the one-frame loops, per loop, on any tier."""
    freed = {"device": 0, "host": 0}

    def wrap(name: str, fn: Callable[[Any, int], int]) -> Callable[[Any, int], int]:
        def spied(tier: Any, amount: int) -> int:
            got = fn(tier, amount)
            freed[name] += got
            return got

        return spied

    monkeypatch.setattr(
        host_tier_module,
        "evict_device_full",
        wrap("device", host_tier_module.evict_device_full),
    )
    monkeypatch.setattr(
        host_tier_module, "evict_host_full", wrap("host", host_tier_module.evict_host_full)
    )
    return freed


def _state(h: Hierarchy) -> object:
    s = tree_state(h.tree, h.cache)
    return (s.nodes, s.components, s.lrus, s.device_heap, s.host_heap, s.host_tier, s.pools)


@pytest.mark.parametrize("events", [False, True])
def test_same_state_as_the_per_node_loops(
    closing: list[Hierarchy], monkeypatch: pytest.MonkeyPatch, walks: str, events: bool
) -> None:
    """With events the host eviction takes the per-node loop on both (it queues host events):
    the device eviction's one frame queues the same device events."""
    freed = _spy(monkeypatch)
    made = []
    for _ in range(2):
        h = make_hierarchy("full", page_size=P, device_pages=9, host_pages=16, enable_events=events)
        closing.append(h)
        made.append(h)
    fast, slow = made
    tier = slow.tree.host_tier
    assert isinstance(tier, HostTier)
    tier.evict_device = tier._evict_device_each
    tier.evict = tier._evict_each
    for tokens in _requests():
        hits = [serve(h, tokens) for h in (fast, slow)]
        assert hits[0] == hits[1]
        assert _state(fast) == _state(slow)
        assert fast.tree.num_nodes == slow.tree.num_nodes
        if events:
            assert fast.cache.take_events() == slow.cache.take_events()
    assert freed["device"] > 0
    host = fast.cache.counters.host_evicted_tokens
    assert host > 0 and host == slow.cache.counters.host_evicted_tokens
    assert freed["host"] == (0 if events else host)


class _CountingTree(UnifiedRadixCache):
    """Sees every `remove_leaf` (host eviction's: `evicted=False`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host_removed = 0

    def remove_leaf(self, node: TreeNode, *, evicted: bool) -> int:
        if not evicted:
            self.host_removed += node.num_tokens
        return super().remove_leaf(node, evicted=evicted)


class _CountingFull(FullComponent):
    """Sees every `queue_free` (a demotion's device slots) and `release` (a node leaving)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queued = 0
        self.released = 0  # device tokens of the nodes released
        self.released_off_device = 0  # nodes released without device slots (host eviction)

    def queue_free(self, slots: Any) -> None:
        self.queued += len(slots)
        super().queue_free(slots)

    def release(self, node: TreeNode, node_goes: bool) -> int:
        self.released += len(node.value)
        self.released_off_device += not len(node.value)
        return super().release(node, node_goes)


def test_a_tree_subclass_keeps_its_remove_leaf_in_host_eviction(
    full_hierarchy_of: Callable[[type[UnifiedRadixCache], type[FullComponent]], Hierarchy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-frame host eviction inlines `remove_leaf`: a subclass of the tree does not get
    it (as the compiled device-only eviction), so every node host eviction takes out still
    goes through the override."""
    freed = _spy(monkeypatch)
    h = full_hierarchy_of(_CountingTree, FullComponent)
    for tokens in _requests():
        serve(h, tokens)
    tree = h.tree
    assert isinstance(tree, _CountingTree)
    evicted = h.cache.counters.host_evicted_tokens
    assert evicted > 0
    assert tree.host_removed == evicted
    assert freed == {"device": 0, "host": 0}


def test_a_full_component_subclass_keeps_its_queue_free_and_release(
    full_hierarchy_of: Callable[[type[UnifiedRadixCache], type[FullComponent]], Hierarchy],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-frame loops inline `FullComponent.queue_free` (a demotion) and `release` (a
    host-evicted node): a subclass of the component keeps both, as it keeps its own
    `take_pending` (no compiled `drain`)."""
    freed = _spy(monkeypatch)
    h = full_hierarchy_of(UnifiedRadixCache, _CountingFull)
    for tokens in _requests():
        serve(h, tokens)
    full = h.tree.components[0]
    assert isinstance(full, _CountingFull)
    tier = h.tree.host_tier
    assert isinstance(tier, HostTier)
    # Every device token that left went through an override: demoted (queued) or with its
    # node (released); every host-evicted node was released.
    assert full.queued > 0 and full.queued + full.released == full.evicted_total
    assert h.cache.counters.host_evicted_tokens > 0 and full.released_off_device > 0
    assert freed == {"device": 0, "host": 0}
    h.cache.check_integrity()


class _SubTier(HostTier):
    pass


@pytest.mark.parametrize(
    ("tree_cls", "full_cls", "tier_cls", "one_frame"),
    [
        (UnifiedRadixCache, FullComponent, HostTier, True),
        (_CountingTree, FullComponent, HostTier, False),
        (UnifiedRadixCache, _CountingFull, HostTier, False),
        (UnifiedRadixCache, FullComponent, _SubTier, False),
    ],
)
def test_only_the_exact_classes_take_the_one_frame_loops(
    tree_cls: type[UnifiedRadixCache],
    full_cls: type[FullComponent],
    tier_cls: type[HostTier],
    one_frame: bool,
) -> None:
    """A subclass of the host tier keeps its per-node helpers (`_drop_device`, `_evict_node`,
    ...) as a subclass of the tree or of Full keeps its overrides."""
    tree = tree_cls([full_cls(make_full_allocator(size=64, page_size=P))], page_size=P)
    tier = tier_cls(tree, make_full_allocator(size=64, page_size=P))
    assert tier._one_frame is one_frame


@pytest.mark.parametrize("nth", [1, 2])
def test_an_error_inside_host_eviction_leaves_the_per_node_loops_state(
    closing: list[Hierarchy], monkeypatch: pytest.MonkeyPatch, walks: str, nth: int
) -> None:
    """Host eviction has no roll-back: an exception from inside it (here the `nth` push of a
    parent that became a candidate, after the push) leaves the nodes already taken out gone
    and their host slots not yet freed. The one-frame loop must leave that state exactly as
    the per-node loop does, sizes and node count included."""
    made = []
    for _ in range(2):
        h = make_hierarchy("full", page_size=P, device_pages=9, host_pages=16)
        closing.append(h)
        made.append(h)
    fast, slow = made
    tiers = []
    for h in made:
        tier = h.tree.host_tier
        assert isinstance(tier, HostTier)
        tiers.append(tier)
    tiers[1].evict = tiers[1]._evict_each
    for tokens in _requests()[:12]:
        for h in made:
            serve(h, tokens)
    assert _state(fast) == _state(slow)
    pushes: dict[int, int] = {}
    original = LeafHeap.push

    def failing(heap: LeafHeap, node: TreeNode) -> None:
        original(heap, node)
        for tier in tiers:
            if heap is tier.heap:
                pushes[id(tier)] = pushes.get(id(tier), 0) + 1
                if pushes[id(tier)] == nth:
                    raise RuntimeError("injected")

    monkeypatch.setattr(LeafHeap, "push", failing)
    for tier in tiers:
        with pytest.raises(RuntimeError, match="injected"):
            tier.evict(10**6)
    monkeypatch.undo()
    assert pushes == {id(tiers[0]): nth, id(tiers[1]): nth}
    # The per-node loop leaves the removed nodes' (empty) device values queued on Full; the
    # next operation's flush drops them, freeing nothing.
    for h in made:
        h.tree.flush_pending()
    assert _state(fast) == _state(slow)
    assert fast.tree.num_nodes == slow.tree.num_nodes
    assert tiers[0].evicted_total == tiers[1].evicted_total > 0
