"""Issue 17, tiered trees: an `evict` on a tree with a host tier (Full + SWA, Full + Mamba; with
and without storage) that raises because a component's allocator would refuse a free leaves the
tree, the host tier, every allocator and the metrics exactly as they were (`tree_state`: node
set, per-node device and host data, locks, heaps with their keys, LRU orders, host candidates,
free lists, Prometheus samples). The refusal reaches the evict at every stage: in the Full walk
(a node going off the device drops its Mamba state), in a component's own eviction after the
walk moved nodes (SWA removing a leaf without a host copy, Mamba dropping a state), and in a
walk that split a node with host copies. After the engine's mistake is undone the tree passes
`check_integrity` and evicts as it would have."""

from __future__ import annotations

import pytest
import torch

from kvstrata.storage import MemoryStorage
from kvstrata.testkit.refusals import refusing, tree_state
from kvstrata.testkit.tiers import Hierarchy, Shape, make_hierarchy, serve
from kvstrata.unified_radix_cache import EvictRequest, MambaComponent, MambaInsert, RadixKey
from kvstrata.unified_radix_cache.errors import HeldSlotsNotAllocated, HeldSlotsRepeated
from kvstrata.unified_radix_cache.paths import node_at

P = 4
A = list(range(1, 3 * P + 1))  # 3 pages
AB = [*A, *range(50, 50 + 2 * P)]  # A + 2 pages
C = list(range(200, 200 + 2 * P))


def _build(
    closing: list[Hierarchy], shape: Shape, storage: bool, *, events: bool = False
) -> Hierarchy:
    h = make_hierarchy(
        shape,
        page_size=P,
        device_pages=24,
        storage=MemoryStorage(capacity_bytes=1 << 22) if storage else None,
        enable_events=events,
    )
    closing.append(h)
    return h


def _no_host_leaf(h: Hierarchy, tokens: list[int]) -> torch.Tensor:
    """A leaf inserted straight into the tree (no write policy ran: it has no host copy);
    returns its slots."""
    slots = h.allocator.alloc(len(tokens))
    assert slots is not None
    inputs = None
    if h.shape == "mamba":
        state = h.cache.alloc_state()
        assert state is not None
        inputs = {"mamba": MambaInsert(slot=int(state))}
    h.tree.insert(RadixKey(tokens), slots, inputs=inputs)
    node = node_at(h.tree, RadixKey(tokens))
    assert node is not None and node.host_value is None
    return slots


def _populate(h: Hierarchy) -> torch.Tensor:
    """A, A+B (host copies: write-through, drained) and C (no host copy); C's slots."""
    for tokens in (A, AB):
        serve(h, tokens)
    return _no_host_leaf(h, C)


def _state_of(h: Hierarchy, tokens: list[int]) -> int:
    mamba = h.tree.component("mamba")
    assert isinstance(mamba, MambaComponent)
    node = node_at(h.tree, RadixKey(tokens))
    assert node is not None
    slot = mamba.slot(node)
    assert slot is not None
    return slot


def _refused(h: Hierarchy, targets: dict[str, int], error: type[Exception]) -> None:
    """`evict(targets)` raises `error` and leaves everything as it was."""
    before = tree_state(h.tree, h.cache)
    with pytest.raises(error):
        h.tree.evict(EvictRequest(targets=targets))
    assert tree_state(h.tree, h.cache) == before


def _everything(h: Hierarchy) -> dict[str, int]:
    return {c.name: h.tree.evictable_size(c.name) for c in h.tree.components}


@pytest.mark.parametrize("storage", [False, True], ids=["host", "host+storage"])
@pytest.mark.parametrize(
    "which",
    [
        pytest.param("full-walk", id="state-dropped-by-the-full-walk"),
        pytest.param("own", id="state-dropped-by-mamba-eviction"),
        pytest.param("split", id="after-a-walk-that-split-a-node"),
        pytest.param("both", id="full-walk-then-mamba"),
    ],
)
def test_mamba_state_freed_behind_the_tree_refuses_with_nothing_changed(
    closing: list[Hierarchy], storage: bool, which: str
) -> None:
    h = _build(closing, "mamba", storage)
    _populate(h)
    states = h.states
    backup = states.backup_state()
    if which == "split":
        # One page of Full: the walk splits A+B's leaf (host copy) and takes its last page off
        # the device, dropping the state at its end.
        states.free(torch.tensor([_state_of(h, AB)]))
        targets = {"full": P}
    elif which == "full-walk":
        states.free(torch.tensor([_state_of(h, A)]))
        targets = {"full": h.tree.evictable_size()}
    elif which == "own":
        states.free(torch.tensor([_state_of(h, C)]))
        targets = {"mamba": h.tree.evictable_size("mamba")}
    else:
        # Full's walk takes A+B's leaf (the least recent) off the device, dropping its state;
        # Mamba's own eviction then reaches C's state.
        states.free(torch.tensor([_state_of(h, C)]))
        targets = {"full": 2 * P, "mamba": h.tree.evictable_size("mamba")}
    _refused(h, targets, HeldSlotsNotAllocated)
    states.restore_state(backup)  # the engine's mistake undone
    h.cache.check_integrity()
    result = h.tree.evict(EvictRequest(targets=targets))
    assert sum(result.evicted.values()) > 0
    h.cache.check_integrity()


@pytest.mark.parametrize("storage", [False, True], ids=["host", "host+storage"])
@pytest.mark.parametrize("full_first", [False, True], ids=["swa-only", "full-walk-then-swa"])
def test_swa_eviction_removing_a_leaf_whose_slots_were_freed_refuses(
    closing: list[Hierarchy], storage: bool, full_first: bool
) -> None:
    """SWA's own eviction removes C (no host copy) whole: its full slots are freed, and the
    engine freed one of them already. With a Full target first, the walk has moved nodes off
    the device (and split one) before SWA's part is refused: all of it is undone."""
    h = _build(closing, "swa", storage)
    c_slots = _populate(h)
    backup = h.swa_allocator.backup_state()
    h.allocator.free(c_slots[-P:].clone())
    targets = {"swa": h.tree.evictable_size("swa")}
    if full_first:
        targets["full"] = 3 * P  # A+B's leaf (2 pages) and the tail page of A: a split
    _refused(h, targets, HeldSlotsNotAllocated)
    h.swa_allocator.restore_state(backup)
    h.cache.check_integrity()
    h.tree.evict(EvictRequest(targets=targets))
    assert node_at(h.tree, RadixKey(C)) is None  # gone whole (no host copy)
    h.cache.check_integrity()


@pytest.mark.parametrize("shape", ["swa", "mamba"])
@pytest.mark.parametrize("amount", [P, 2 * P, 3 * P, 5 * P, None], ids=lambda n: f"full{n}")
def test_injected_refusal_after_a_partial_walk_changes_nothing(
    closing: list[Hierarchy], shape: Shape, amount: int | None
) -> None:
    """A refusing allocator (injected) refuses C's last page, which the Full walk reaches last
    (C is the most recent leaf; before it go A+B's leaf, 2 pages, then A, 3 pages): an evict
    of everything is refused, and every node the walk moved off the device or split first
    comes back, with its host copy whole, its heap key and its place among the host
    candidates. An evict that stops before C (split or whole nodes) refuses nothing."""
    h = _build(closing, shape, False)
    for tokens in (A, AB, C):
        serve(h, tokens)
    c = node_at(h.tree, RadixKey(C))
    assert c is not None and c.host_value is not None
    full = h.tree.components[0]
    with refusing(full, c.value[-P:].tolist()) as proxy:
        if amount is None:
            _refused(h, {"full": h.tree.evictable_size()}, HeldSlotsNotAllocated)
            assert proxy.refusals == 1
        else:
            result = h.tree.evict(EvictRequest.full(amount))
            assert result.evicted["full"] == amount and proxy.refusals == 0
    h.cache.check_integrity()


def test_one_state_slot_on_two_nodes_is_a_repeat_refused_before_any_change(
    closing: list[Hierarchy],
) -> None:
    """A state slot given for two keys (insert checks it is handed out, not that no other node
    holds it): an evict freeing both states would free it twice."""
    h = _build(closing, "mamba", False)
    serve(h, A)
    state = h.cache.alloc_state()
    assert state is not None
    for tokens in (C, [*C, 7, 7, 7, 7]):
        slots = h.allocator.alloc(len(tokens))
        assert slots is not None
        h.tree.insert(RadixKey(tokens), slots, inputs={"mamba": MambaInsert(slot=int(state))})
    _refused(h, {"mamba": h.tree.evictable_size("mamba")}, HeldSlotsRepeated)
    _refused(h, {"full": h.tree.evictable_size()}, HeldSlotsRepeated)
    _refused(h, _everything(h), HeldSlotsRepeated)


def test_a_refused_walk_keeps_a_device_leaf_s_older_heap_key(closing: list[Hierarchy]) -> None:
    """A match that runs over a device leaf into its off-device child without ending on it
    (A has no Mamba state, so the device hit ends before A) moves A's access time but not its
    heap key. A refused evict that took A puts A back with the key it had, not one made from
    its newer access time: the eviction order stays the one before the evict."""
    h = _build(closing, "mamba", False)
    for tokens in (A, AB):
        serve(h, tokens)
    h.tree.evict(EvictRequest(targets={"full": 2 * P}))  # A+B's leaf goes off the device
    a = node_at(h.tree, RadixKey(A))
    assert a is not None and len(a.value) and a.heap_entry is not None
    mamba = h.tree.component("mamba")
    assert isinstance(mamba, MambaComponent)
    h.tree.evict(EvictRequest(targets={"mamba": mamba.evictable_size}))  # A: a state tombstone
    matched = h.tree.match_prefix(RadixKey([*AB, 9]))
    assert matched.prefix_len == 0 and matched.host_hit_len == len(AB)
    assert a.heap_entry[0] < a.last_access  # the key is older than A's access time
    full = h.tree.components[0]
    with refusing(full, a.value[:1].tolist()):
        _refused(h, {"full": h.tree.evictable_size()}, HeldSlotsNotAllocated)
    h.cache.check_integrity()


@pytest.mark.parametrize("shape", ["full", "swa", "mamba"])
def test_refused_evict_with_events_and_locks_held(closing: list[Hierarchy], shape: Shape) -> None:
    """KV events on, a device lock on A and a host lock on A+B's leaf (after it went off the
    device): the refused evict queues no device or host event, and leaves both locks and
    every count they hold as they were; both unlock cleanly after."""
    h = _build(closing, shape, False, events=True)
    for tokens in (A, AB, C):
        serve(h, tokens)
    h.tree.evict(EvictRequest.full(2 * P))  # A+B's leaf (least recent) goes off the device
    ab = node_at(h.tree, RadixKey(AB))
    a = node_at(h.tree, RadixKey(A))
    c = node_at(h.tree, RadixKey(C))
    assert ab is not None and a is not None and c is not None and not len(ab.value)
    tier = h.cache.tier
    host_receipt = tier.lock(ab)
    receipt = h.tree.lock(a)
    h.tree.take_events()
    tier.take_events()
    full = h.tree.components[0]
    with refusing(full, c.value[:P].tolist()) as proxy:
        _refused(h, _everything(h), HeldSlotsNotAllocated)
        assert proxy.refusals == 1
    assert h.tree.take_events() == [] and tier.take_events() == []
    h.tree.unlock(receipt)
    tier.unlock(host_receipt)
    h.cache.check_integrity()
    h.tree.evict(EvictRequest(targets=_everything(h)))
    assert h.tree.evictable_size() == 0
    assert h.tree.take_events()  # the evict that went through reports its removals
    h.cache.check_integrity()
