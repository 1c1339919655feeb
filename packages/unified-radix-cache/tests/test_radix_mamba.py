"""MambaComponent: state on the node, copy-on-write on match, one-node locks, tombstones."""

from __future__ import annotations

import pytest
import torch

from kvstrata.testkit.trees import TreeKit, make_tree
from kvstrata.unified_radix_cache import EvictRequest, MambaComponent, MambaInsert, RadixKey
from kvstrata.unified_radix_cache.errors import InvalidInsert, StateSlotsExhausted

A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def _mamba(kit: TreeKit) -> MambaComponent:
    component = kit.tree.component("mamba")
    assert isinstance(component, MambaComponent)
    return component


def _stamp(kit: TreeKit, slot: torch.Tensor, value: float) -> None:
    assert kit.mamba_pool is not None
    kit.mamba_pool.ssm_state[:, slot] = value
    kit.mamba_pool.conv_state[:, slot] = value


def _stored(kit: TreeKit, tokens: list[int], value: float) -> torch.Tensor:
    """Insert `tokens` with a state slot stamped with `value`; returns the slot."""
    slots = kit.alloc(len(tokens))
    state = kit.alloc_state()
    _stamp(kit, state, value)
    result = kit.tree.insert(
        RadixKey(tokens), slots, inputs={"mamba": MambaInsert(slot=int(state))}
    )
    kit.full.free(result.duplicates(slots))
    assert result.adopted_states == ("mamba",)
    return state


def test_match_ends_only_where_a_state_is_stored() -> None:
    kit = make_tree("mamba", page_size=1)
    tree = kit.tree
    _stored(kit, A + B, 1.0)
    _stored(kit, A + C, 2.0)  # splits A off: A has no state of its own
    assert tree.match_prefix(RadixKey(A)).prefix_len == 0
    assert tree.match_prefix(RadixKey([*A, 99])).prefix_len == 0
    m = tree.match_prefix(RadixKey([*A, *B, 99]))
    assert m.prefix_len == 8 and m.last_node.tokens().tolist() == B
    kit.check()


def test_copy_on_write_gives_the_request_its_own_state() -> None:
    kit = make_tree("mamba", page_size=1)
    tree = kit.tree
    cached = _stored(kit, A + B, 3.0)
    m = tree.match_prefix(RadixKey(A + B), copy_state=True)
    copy = m.states["mamba"]
    assert copy.tolist() != cached.tolist()
    assert kit.mamba_pool is not None
    assert torch.equal(kit.mamba_pool.ssm_state[:, copy], kit.mamba_pool.ssm_state[:, cached])
    _stamp(kit, copy, 9.0)  # the request advances its own state
    assert float(kit.mamba_pool.ssm_state[0, int(cached)].flatten()[0]) == 3.0
    assert _mamba(kit).copies_total == 1
    kit.check({"mamba": 1})
    kit.mamba.free(copy)  # type: ignore[union-attr]
    kit.check()


def test_copy_on_write_evicts_another_state_but_never_the_matched_one() -> None:
    kit = make_tree("mamba", page_size=1, mamba_slots=2)
    tree = kit.tree
    _stored(kit, A, 1.0)
    kept = _stored(kit, B, 2.0)
    m = tree.match_prefix(RadixKey(B), copy_state=True)  # pool full: A's state must go
    assert "mamba" in m.states
    assert tree.match_prefix(RadixKey(A)).prefix_len == 0
    assert tree.match_prefix(RadixKey(B)).prefix_len == 4
    assert int(m.last_node.comp_values[_mamba(kit).index]) == int(kept)  # type: ignore[index, arg-type]
    kit.check({"mamba": 1})
    with pytest.raises(StateSlotsExhausted):
        tree.match_prefix(RadixKey(B), copy_state=True)  # only the matched state is left
    kit.check({"mamba": 1})


def test_lock_protects_the_anchor_state_only() -> None:
    kit = make_tree("mamba", page_size=1)
    tree = kit.tree
    _stored(kit, A, 1.0)
    _stored(kit, A + B, 2.0)
    m = tree.match_prefix(RadixKey(A + B))
    receipt = tree.lock(m.last_node)
    assert receipt.boundaries == (None, 1)
    assert tree.protected_size("mamba") == 1 and tree.evictable_size("mamba") == 1
    r = tree.evict(EvictRequest(targets={"mamba": 5}))
    assert r.evicted == {"full": 0, "mamba": 1}  # A's state: A is internal, so a tombstone
    assert tree.evictable_size("full") == 0 and tree.num_nodes == 2
    kit.check()
    tree.unlock(receipt)
    kit.check()


def test_mamba_eviction_removes_an_unlocked_leaf_whole() -> None:
    kit = make_tree("mamba", page_size=2)
    tree = kit.tree
    _stored(kit, A, 1.0)
    r = tree.evict(EvictRequest(targets={"mamba": 1}))
    assert r.evicted == {"full": 4, "mamba": 1} and tree.num_nodes == 0
    kit.check()


def test_lock_skips_an_anchor_without_state() -> None:
    kit = make_tree("mamba", page_size=1)
    kit.put(A + C)
    kit.put(A + B)
    anchor = next(n for n in kit.tree.iter_nodes() if n.tokens().tolist() == A)
    receipt = kit.tree.lock(anchor)
    assert receipt.skipped == ("mamba",)
    kit.tree.unlock(receipt)
    kit.check()


def test_state_input_needs_an_aligned_key_and_is_not_adopted_twice() -> None:
    kit = make_tree("mamba", page_size=4)
    slots = kit.alloc(8)[:6]
    state = kit.alloc_state()
    with pytest.raises(InvalidInsert):
        kit.tree.insert(
            RadixKey(list(range(6))), slots, inputs={"mamba": MambaInsert(slot=int(state))}
        )
    assert kit.tree.num_nodes == 0
    kit.full.free(slots)
    kit.mamba.free(state)  # type: ignore[union-attr]
    _stored(kit, A, 1.0)
    second = kit.alloc_state()
    slots = kit.alloc(4)
    result = kit.tree.insert(RadixKey(A), slots, inputs={"mamba": MambaInsert(slot=int(second))})
    assert result.adopted_states == ()
    kit.full.free(result.duplicates(slots))
    kit.mamba.free(second)  # type: ignore[union-attr]
    kit.check()
