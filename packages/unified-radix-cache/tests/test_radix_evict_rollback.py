"""Issue 17: `evict` on a device-only tree with SWA or Mamba state never leaves the tree (or any
allocator) changed when it raises. The failure is a free the allocator would refuse: the engine
freed slots the tree holds behind its back (Full, SWA's full slots, a Mamba state slot). Each
test compares a full snapshot (structure, per-component data, sizes, LRU order, heap, events,
pools) before and after the refused evict, then checks the tree still evicts and matches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.allocator import (
    DuplicateIndex,
    MambaSlotAllocator,
    NotAllocated,
    PagedAllocator,
    SWAAllocator,
)
from kvstrata.testkit.trees import TreeKit, make_tree
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    MambaInsert,
    RadixKey,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.components.base import LRUListComponent
from kvstrata.unified_radix_cache.errors import HeldSlotsNotAllocated, HeldSlotsRepeated


def snapshot(tree: UnifiedRadixCache) -> tuple[object, ...]:
    """Everything a refused evict must leave as it was (read-only: no access time moves)."""
    nodes = []
    for n in sorted(tree.iter_nodes(), key=lambda n: n.id):
        values = [v.tolist() if isinstance(v, np.ndarray) else v for v in (n.comp_values or [])[1:]]
        assert n.parent is not None
        nodes.append((n.id, n.parent.id, n.key, n.value.tolist(), values, n.lock_ref, n.heap_entry))
    sizes = [(c.name, c.evictable_size, c.protected_size, c.evicted_total) for c in tree.components]
    lrus = [
        [n.id for n in c.lru.nodes()] for c in tree.components if isinstance(c, LRUListComponent)
    ]
    full = tree.components[0]
    assert isinstance(full, FullComponent) and full.heap is not None
    heap = sorted(n.id for n in tree.iter_nodes() if n in full.heap)
    frees = [c.free_size() for c in tree.components]
    return (tuple(nodes), sizes, lrus, heap, tree.num_nodes, frees)


def _matches(tree: UnifiedRadixCache, keys: list[list[int]]) -> list[tuple[int, list[int]]]:
    out = []
    for tokens in keys:
        m = tree.match_prefix(RadixKey(tokens))
        out.append((m.prefix_len, m.device_indices.tolist()))
    return out


def _swa_kit(page_size: int) -> tuple[TreeKit, dict[str, torch.Tensor]]:
    """A shared prefix A with branches B, C and a separate key D (LRU order: A+B, A+C, D)."""
    kit = make_tree("swa", size=128, page_size=page_size, sliding_window=4)
    a = list(range(1, 9))
    keys = {"ab": a + list(range(100, 108)), "ac": a + list(range(200, 216)), "d": [7] * 8}
    slots: dict[str, torch.Tensor] = {}
    for name, tokens in keys.items():
        result, given = kit.put(tokens)
        slots[name] = given[result.prefix_len :]
    return kit, slots


def _refused(kit: TreeKit, targets: dict[str, int], keys: list[list[int]]) -> None:
    tree = kit.tree
    matched = _matches(tree, keys)
    before = snapshot(tree)
    with pytest.raises(HeldSlotsNotAllocated) as caught:
        tree.evict(EvictRequest(targets=targets))
    assert isinstance(caught.value, NotAllocated)
    assert snapshot(tree) == before
    assert _matches(tree, keys) == matched


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "targets",
    [
        {"full": 64},  # everything Full can take
        {"full": 20},  # ends inside leaf A+C: a split and a tail removal to undo
        {"swa": 64},  # SWA's own order: leaves go whole, A becomes a tombstone first
        {"full": 4, "swa": 64},
    ],
)
def test_swa_tree_evict_refused_by_the_allocator_changes_nothing(
    page_size: int, targets: dict[str, int]
) -> None:
    kit, slots = _swa_kit(page_size)
    assert isinstance(kit.full, SWAAllocator)
    keys = [list(range(1, 9)) + list(range(200, 216)), [7] * 8]
    state = kit.full.backup_state()
    kit.full.free(slots["ac"][-page_size:])  # the engine frees the tree's last page of A+C
    _refused(kit, targets, keys)
    kit.full.restore_state(state)  # the engine's mistake undone: every invariant holds again
    kit.check()
    # The tree still evicts in its own order: A+B goes first, whole.
    done = kit.tree.evict(EvictRequest(targets={"full": 8}))
    assert done.evicted["full"] == 8
    ab = list(range(1, 9)) + list(range(100, 108))
    assert kit.tree.match_prefix(RadixKey(ab)).prefix_len == 8
    kit.check()


def test_swa_tombstones_come_back_when_a_later_leaf_is_refused() -> None:
    kit, slots = _swa_kit(1)
    assert isinstance(kit.full, SWAAllocator)
    swa = kit.tree.component("swa")
    assert isinstance(swa, LRUListComponent)
    state = kit.full.backup_state()
    kit.full.free(slots["d"])
    # SWA evicts A+B (leaf, whole) and tombstones A before it reaches D, whose free is refused.
    _refused(kit, {"swa": 64}, [[7] * 8])
    kit.full.restore_state(state)
    kit.check()
    assert swa.evictable_size == 40


AC = [*range(1, 9), 60, 61, 62, 63]


def _mamba_kit() -> tuple[TreeKit, list[torch.Tensor]]:
    kit = make_tree("mamba", size=128, page_size=1, mamba_slots=8)
    a = list(range(1, 9))
    for tokens in (a, [*a, 50, 51, 52, 53], [*a, 60, 61, 62, 63], [7] * 4):
        kit.put(tokens)
    mamba = kit.tree.component("mamba")
    assert isinstance(mamba, LRUListComponent)
    states = [torch.tensor([mamba.slot(n)]) for n in mamba.lru.nodes()]  # type: ignore[attr-defined]
    return kit, states


@pytest.mark.parametrize("which", [0, 1, 3])  # A (internal: tombstone), A+5x (leaf), D
@pytest.mark.parametrize("full", [0, 12])
def test_mamba_tree_evict_refused_by_the_allocator_changes_nothing(which: int, full: int) -> None:
    kit, states = _mamba_kit()
    assert isinstance(kit.mamba, MambaSlotAllocator)
    state = kit.mamba.backup_state()
    kit.mamba.free(states[which])  # the engine frees a state slot the tree holds
    keys = [AC, [7] * 4]
    _refused(kit, {"mamba": 4, "full": full}, keys)
    kit.mamba.restore_state(state)
    kit.check()
    done = kit.tree.evict(EvictRequest(targets={"mamba": 1}))
    assert done.evicted["mamba"] == 1
    kit.check()


def test_mamba_full_refusal_undoes_the_state_evictions_before_it() -> None:
    kit, _ = _mamba_kit()
    state = kit.full.backup_state()
    d = next(n for n in kit.tree.iter_nodes() if n.tokens().tolist() == [7] * 4)
    kit.full.free(torch.from_numpy(d.value.copy()))
    _refused(kit, {"mamba": 2, "full": 64}, [AC])
    kit.full.restore_state(state)
    kit.check()


def test_a_slot_held_twice_is_refused_before_any_free() -> None:
    """One Mamba state slot given for two keys (insert checks it is handed out, not that no
    other node holds it): evicting both in one call would free it twice. Refused with nothing
    changed."""
    kit = make_tree("mamba", size=64, page_size=1, mamba_slots=4)
    tree = kit.tree
    state = kit.alloc_state()
    for tokens in ([1, 2, 3], [4, 5, 6]):
        tree.insert(RadixKey(tokens), kit.alloc(3), inputs={"mamba": MambaInsert(slot=int(state))})
    before = snapshot(tree)
    with pytest.raises(HeldSlotsRepeated):
        tree.evict(EvictRequest(targets={"mamba": 2}))
    assert snapshot(tree) == before


@pytest.mark.parametrize("events", [False, True])
def test_full_only_tree_without_slot_checks_refuses_a_double_free(events: bool) -> None:
    """The issue's example with `check_slots=False`: insert trusts the caller, and the evict
    that would free one slot twice raises before any change instead of leaking it."""
    alloc = PagedAllocator(size=64, page_size=1, device="cpu")
    full = FullComponent(alloc)
    tree = UnifiedRadixCache([full], page_size=1, check_slots=False, enable_events=events)
    v = alloc.alloc(8)
    assert v is not None
    tree.insert(RadixKey(range(100, 116)), torch.cat([v, v]))
    tree.take_events()
    before = (snapshot(tree), alloc.available_size())
    with pytest.raises(HeldSlotsRepeated) as caught:
        tree.evict(EvictRequest.full(16))
    assert isinstance(caught.value, DuplicateIndex)
    assert (snapshot(tree), alloc.available_size()) == before
    assert tree.take_events() == []
    assert tree.match_prefix(RadixKey(range(100, 116))).prefix_len == 16
