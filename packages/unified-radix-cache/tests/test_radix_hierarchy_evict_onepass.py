"""The one-pass device eviction of a Full-only tree with a host tier (`tree.evict` ->
`evict_undo.evict_full_tiered`, whose walk is `host_evict.evict_device_full`) against the
general path it replaces (`evict_targets` over the tier's per-node walk,
`HostTier._evict_device_each`): twin hierarchies served the same requests must evict the same
nodes (same victims, demotions, splits, heaps, host candidates, free lists), and refuse the
same evicts (HeldSlotsNotAllocated, HeldSlotsRepeated) with the same message and nothing
changed. The slow twin's host eviction takes the per-node path too (`HostTier._evict_each`),
but these requests never fill the host: test_radix_host_evict_oneframe.py compares the
one-frame host eviction."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext

import pytest
import torch

from kvstrata.pool import native
from kvstrata.testkit.refusals import refusing, tree_state
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, serve
from kvstrata.unified_radix_cache import EvictRequest, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache import tree as tree_module
from kvstrata.unified_radix_cache.errors import HeldSlotsNotAllocated, HeldSlotsRepeated
from kvstrata.unified_radix_cache.evict_undo import EvictJournal, evict_full_tiered, evict_targets
from kvstrata.unified_radix_cache.host_tier import HostTier
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.policies import LeafHeap

P = 4
A = list(range(1, 3 * P + 1))
AB = [*A, *range(50, 50 + 2 * P)]
AC = [*A, *range(90, 90 + 3 * P)]
D = list(range(200, 200 + 2 * P))
E = list(range(300, 300 + 4 * P))


def _fast(tree: UnifiedRadixCache, amount: int) -> dict[str, int]:
    return dict(tree.evict(EvictRequest.full(amount)).evicted)


def _general(tree: UnifiedRadixCache, amount: int) -> dict[str, int]:
    return evict_targets(tree, {"full": amount})


Evict = Callable[[UnifiedRadixCache, int], dict[str, int]]


@pytest.fixture(autouse=True, params=["compiled", "python"])
def walks(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test twice: with the tree's compiled core (walks, `drain`), then without it
    (hierarchies made inside `native.disabled()`, as CI's KVSTRATA_NATIVE=0 run)."""
    with nullcontext() if request.param == "compiled" else native.disabled():
        yield request.param


def _twins(closing: list[Hierarchy]) -> tuple[Hierarchy, Hierarchy]:
    made = []
    for _ in range(2):
        h = make_hierarchy("full", page_size=P, device_pages=24, host_pages=48)
        closing.append(h)
        made.append(h)
    tier = made[1].tree.host_tier
    assert isinstance(tier, HostTier)
    tier.evict_device = tier._evict_device_each
    tier.evict = tier._evict_each
    return made[0], made[1]


def _state(h: Hierarchy) -> object:
    s = tree_state(h.tree, h.cache)
    # The metrics count `tree.evict` calls, which `evict_targets` alone does not.
    return (s.nodes, s.components, s.lrus, s.device_heap, s.host_heap, s.host_tier, s.pools)


def _outcome(h: Hierarchy, evict: Evict, amount: int) -> tuple[str, object]:
    try:
        return "ok", evict(h.tree, amount)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return type(exc).__name__, str(exc)


def _both(
    fast: Hierarchy, slow: Hierarchy, amount: int, *, check: bool = True
) -> tuple[str, object]:
    """Evict `amount` on both (one path each): same result or error, same state after; a
    refusal changes nothing. `check`: both pass `check_integrity` after."""
    before = _state(fast)
    got = _outcome(fast, _fast, amount)
    assert got == _outcome(slow, _general, amount)
    assert _state(fast) == _state(slow)
    if got[0] != "ok":
        assert _state(fast) == before
    for h in (fast, slow):
        if check:
            h.cache.check_integrity()
    return got


@pytest.mark.parametrize("amounts", [[P, 2 * P, 3 * P, 100 * P], [1, 5, 2 * P + 1, 100 * P]])
def test_same_victims_as_the_general_path(closing: list[Hierarchy], amounts: list[int]) -> None:
    fast, slow = _twins(closing)
    for tokens in (A, AB, AC, D, E, AB):
        for h in (fast, slow):
            serve(h, tokens)
    assert _state(fast) == _state(slow)
    for amount in amounts:
        got = _both(fast, slow, amount)
        assert got[0] == "ok"
    assert fast.tree.evictable_size() == 0
    for tokens in (AC, D):  # host hits load back into what the evicts left
        for h in (fast, slow):
            serve(h, tokens)
    assert _state(fast) == _state(slow)
    _both(fast, slow, 3 * P)


def test_the_tree_takes_the_one_pass_path(
    closing: list[Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin tests above compare against the general path, so they would pass if `evict`
    never took the one pass: a Full-only tiered tree's `evict` must call it (once per evict
    with a target), and nothing else."""
    h = _twins(closing)[0]
    for tokens in (A, AB, D):
        serve(h, tokens)
    calls: list[int] = []

    def one_pass(tree: UnifiedRadixCache, amount: int) -> None:
        calls.append(amount)
        evict_full_tiered(tree, amount)

    monkeypatch.setattr(tree_module, "evict_full_tiered", one_pass)
    monkeypatch.setattr(tree_module, "evict_targets", _refuse_general)
    assert _fast(h.tree, 2 * P) == {"full": 2 * P}
    assert _fast(h.tree, 0) == {"full": 0}
    assert calls == [2 * P]
    h.cache.check_integrity()


def _refuse_general(tree: UnifiedRadixCache, targets: object) -> dict[str, int]:
    raise AssertionError(f"the general path was taken for {targets}")


@pytest.mark.parametrize("amount", [P, 3 * P, 100 * P])
def test_a_refused_slot_refuses_as_the_general_path(closing: list[Hierarchy], amount: int) -> None:
    fast, slow = _twins(closing)
    for tokens in (A, AB, D):
        for h in (fast, slow):
            serve(h, tokens)
    # D is the most recent leaf: only an evict of everything reaches its last page.
    refused = [_leaf(h, D)[-P:].tolist() for h in (fast, slow)]
    assert refused[0] == refused[1]
    with (
        refusing(fast.tree.components[0], refused[0]),
        refusing(slow.tree.components[0], refused[1]),
    ):
        got = _both(fast, slow, amount)
    assert got[0] == ("HeldSlotsNotAllocated" if amount > 6 * P else "ok")
    _both(fast, slow, 100 * P)


def test_a_slot_held_twice_is_refused_as_the_general_path(closing: list[Hierarchy]) -> None:
    """`check_slots=False`: insert trusts the engine, so the evict itself must refuse a Full
    slot two nodes hold (a double free), before any change."""
    fast, slow = _twins(closing)
    held = []
    for h in (fast, slow):
        h.tree.check_slots = False
        h.tree._slot_checker = None
        serve(h, A)
        slots = h.allocator.alloc(2 * P)
        assert slots is not None
        held.append(slots.tolist())
        for tokens in (D, E[: 2 * P]):  # no host copy: both leaves leave the tree whole
            h.tree.insert(RadixKey(tokens), slots)
    assert held[0] == held[1]
    # (No integrity check: the pool counts a slot held twice twice, which is the fault.)
    got = _both(fast, slow, 100 * P, check=False)
    assert got[0] == "HeldSlotsRepeated"
    with pytest.raises(HeldSlotsRepeated):
        fast.tree.evict(EvictRequest.full(100 * P))
    # One of the two freed behind the tree's back: the allocator's check comes first.
    with pytest.raises(HeldSlotsNotAllocated), refusing(fast.tree.components[0], held[0][:1]):
        fast.tree.evict(EvictRequest.full(100 * P))
    _both(fast, slow, 3 * P, check=False)  # A's leaf alone (least recent): no repeat reached


def _leaf(h: Hierarchy, tokens: list[int]) -> torch.Tensor:
    node = node_at(h.tree, RadixKey(tokens))
    assert node is not None
    return torch.from_numpy(node.value)


@pytest.mark.parametrize(("where", "nth"), [("node", 1), ("node", 2), ("push", 1), ("push", 2)])
def test_any_error_in_the_walk_rolls_back_as_the_general_path(
    closing: list[Hierarchy], monkeypatch: pytest.MonkeyPatch, where: str, nth: int
) -> None:
    """Not a refusal: an exception from inside the tier's device walk puts everything back on
    both paths (the one-frame walk and the per-node one). Injected into a step both walks
    take, after it did its work: the journal's record of the `nth` node taken (before its
    split or pop), or the `nth` heap push (a node joining the host candidates, or a parent
    becoming a device leaf)."""
    fast, slow = _twins(closing)
    for tokens in (A, AB, AC, D):
        for h in (fast, slow):
            serve(h, tokens)
    owners: dict[int, Hierarchy] = {}
    for h in (fast, slow):
        tier = h.tree.host_tier
        assert isinstance(tier, HostTier)
        owners[id(tier.heap)] = owners[id(h.tree.components[0].heap)] = h  # pyright: ignore[reportAttributeAccessIssue]
    calls: dict[int, int] = {}
    cls = EvictJournal if where == "node" else LeafHeap
    original = getattr(cls, where)
    armed = [False]

    def failing(self: object, node: TreeNode) -> None:
        original(self, node)
        h = (
            owners.get(id(self))
            if where == "push"
            else next((h for h in (fast, slow) if h.tree._journal is self), None)
        )
        if armed[0] and h is not None:
            calls[id(h)] = calls.get(id(h), 0) + 1
            if calls[id(h)] == nth:
                raise RuntimeError("injected")

    monkeypatch.setattr(cls, where, failing)
    armed[0] = True
    got = _both(fast, slow, 100 * P)
    armed[0] = False
    assert got == ("RuntimeError", "injected")
    assert calls == {id(fast): nth, id(slow): nth}
    _both(fast, slow, 100 * P)
