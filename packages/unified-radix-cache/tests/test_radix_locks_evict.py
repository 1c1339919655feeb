"""BEHAVIOURS.md 9-13: lifetime, locking and eviction, for Full, Full+SWA and Full+Mamba trees."""

from __future__ import annotations

import pytest
import torch

from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import EvictRequest, RadixKey
from kvstrata.unified_radix_cache.errors import (
    ForeignNode,
    InvalidEvictRequest,
    ReceiptAlreadyReleased,
    ReceiptMismatch,
    TreeLocked,
    UnknownReceipt,
)

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority")


def _block(i: int, n: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(n)]


@pytest.mark.parametrize("page_size", (1, 4))
def test_lock_moves_path_to_protected_and_back(family: str, page_size: int) -> None:
    """9. lock moves the path from evictable to protected; unlock moves it back."""
    kit = make_tree(family, page_size=page_size, sliding_window=1)
    tree = kit.tree
    kit.put(list(range(16)))
    kit.put([*range(8), *range(100, 108)])  # splits: [0..8) shared, two 8-token leaves
    m = tree.match_prefix(RadixKey(list(range(16))))
    assert m.prefix_len == 16
    receipt = tree.lock(m.last_node)
    assert tree.protected_size() == 16 and tree.evictable_size() == 8
    kit.check()
    tree.unlock(receipt)
    assert tree.protected_size() == 0 and tree.evictable_size() == 24
    kit.check()


def test_second_unlock_and_foreign_receipts_fail_before_changing_anything(family: str) -> None:
    """9. A second unlock with the same receipt, or an unlock without a lock, is an error."""
    kit = make_tree(family)
    other = make_tree(family)
    tree = kit.tree
    kit.put(list(range(8)))
    other.put(list(range(8)))
    receipt = tree.lock(tree.match_prefix(RadixKey(list(range(8)))).last_node)
    foreign = other.tree.lock(other.tree.match_prefix(RadixKey(list(range(8)))).last_node)
    with pytest.raises(UnknownReceipt):
        tree.unlock(foreign)
    with pytest.raises(ReceiptMismatch):
        tree.unlock(receipt._replace(anchor=tree.root))
    tree.unlock(receipt)
    with pytest.raises(ReceiptAlreadyReleased):
        tree.unlock(receipt)
    assert tree.protected_size() == 0 and tree.num_locked == 0
    kit.check()


def test_lock_refuses_an_evicted_node() -> None:
    kit = make_tree("full")
    kit.put(list(range(4)))
    node = kit.tree.match_prefix(RadixKey(list(range(4)))).last_node
    kit.tree.evict(EvictRequest.full(4))
    with pytest.raises(ForeignNode):
        kit.tree.lock(node)
    kit.check()


@pytest.mark.parametrize("page_size", (1, 2))
def test_evict_takes_unlocked_leaves_and_parents_follow(family: str, page_size: int) -> None:
    """10. Eviction frees at least what was asked, only unlocked leaves, returns slots to the
    allocator, and a parent becomes evictable when its last child goes."""
    kit = make_tree(family, page_size=page_size)
    tree = kit.tree
    kit.put([*range(4), *range(10, 14)])  # tick 1
    kit.put([*range(4), *range(20, 24)])  # tick 2: shares [0..4)
    free_before = kit.full.available_size()
    r = tree.evict(EvictRequest.full(4))  # the oldest leaf: a's tail
    assert r.num_evicted() == 4 and kit.full.available_size() == free_before + 4
    assert tree.match_prefix(RadixKey([*range(4), *range(10, 14)])).prefix_len in (0, 4)
    r = tree.evict(EvictRequest.full(4))  # b's tail
    assert r.num_evicted() == 4
    assert tree.evictable_size() == 4  # the shared parent is now an evictable leaf
    r = tree.evict(EvictRequest.full(100))  # asks more than there is: everything evictable
    assert r.num_evicted() == 4 and tree.num_nodes == 0
    assert kit.full.available_size() == kit.full.size
    kit.check()


@pytest.mark.parametrize("page_size", (1, 2, 4))
def test_eviction_is_page_granular_from_the_leaf_tail(page_size: int) -> None:
    """The last leaf gives up only the tail pages needed (SGLang drops it whole)."""
    kit = make_tree("full", page_size=page_size)
    tree = kit.tree
    _, slots = kit.put(list(range(4 * page_size)))
    free_before = kit.full.available_size()
    r = tree.evict(EvictRequest.full(page_size + 1))  # needs 2 pages
    assert r.num_evicted() == 2 * page_size
    assert kit.full.available_size() == free_before + 2 * page_size
    m = tree.match_prefix(RadixKey(list(range(4 * page_size))))
    assert m.device_indices.tolist() == slots[: 2 * page_size].tolist()
    assert r.nodes_removed == 0 and tree.evictable_size() == 2 * page_size
    kit.check()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 4))
def test_eviction_order_follows_the_policy(
    family: str, policy: str, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10. Exact eviction order and exact slots freed: three leaves A, B, C inserted in that
    order (priorities 5, 1, 3), then A matched twice and C once."""
    kit = make_tree(family, page_size=page_size, policy=policy)
    tree = kit.tree
    n = 2 * page_size
    blocks = {name: _block(i, n) for i, name in enumerate("ABC")}
    priorities = {"A": 5, "B": 1, "C": 3}
    slots = {name: kit.put(blocks[name], priority=priorities[name])[1] for name in "ABC"}
    for name in "AAC":
        tree.match_prefix(RadixKey(blocks[name]))
    expected = {
        "lru": "BAC",
        "mru": "CAB",
        "fifo": "ABC",
        "filo": "CBA",
        "lfu": "BCA",
        "priority": "BCA",
    }[policy]

    def present() -> set[str]:  # read the structure only: a match would touch access times
        firsts = {int(node.tokens()[0]) for node in tree.iter_nodes()}
        return {k for k, v in blocks.items() if v[0] in firsts}

    freed: list[int] = []
    free = kit.full.free

    def recording_free(indices: torch.Tensor) -> None:
        freed.extend(indices.tolist())
        free(indices)

    monkeypatch.setattr(kit.full, "free", recording_free)
    order = ""
    for _ in range(3):
        before = present()
        free_before = kit.full.available_size()
        tree.evict(EvictRequest.full(n))
        (gone,) = before - present()
        assert kit.full.available_size() == free_before + n
        assert sorted(freed) == sorted(slots[gone].tolist())  # exactly that leaf's slots
        freed.clear()
        order += gone
        kit.check()
    assert order == expected


def test_priority_propagates_up_as_the_max_of_descendants() -> None:
    kit = make_tree("full", page_size=1, policy="priority")
    tree = kit.tree
    kit.put([1, 2, 3, 4], priority=1)
    kit.put([1, 2, 5, 6], priority=9)
    kit.put([7, 8], priority=4)
    shared = tree.match_prefix(RadixKey([1, 2])).last_node
    assert shared.priority == 9
    # leaves by priority: [3,4] (1), then [7,8] (4), then [5,6] (9), then the shared parent
    tree.evict(EvictRequest.full(2))
    assert tree.match_prefix(RadixKey([1, 2, 3, 4])).prefix_len == 2
    tree.evict(EvictRequest.full(2))
    assert tree.match_prefix(RadixKey([7, 8])).prefix_len == 0
    assert tree.match_prefix(RadixKey([1, 2, 5, 6])).prefix_len == 4
    kit.check()


def test_matched_slots_survive_eviction_for_the_same_request(family: str) -> None:
    """11. A request's matched prefix, once locked, is not evicted to make room for it."""
    kit = make_tree(family, page_size=2, sliding_window=2)
    tree = kit.tree
    kit.put(list(range(8)))
    kit.put(list(range(100, 108)))
    m = tree.match_prefix(RadixKey([*range(8), 50, 51]))
    receipt = tree.lock(m.last_node)
    tree.evict(EvictRequest(targets={c.name: 1000 for c in tree.components}))
    assert (
        tree.match_prefix(RadixKey(list(range(8)))).device_indices.tolist()
        == m.device_indices.tolist()
    )
    assert tree.match_prefix(RadixKey(list(range(100, 108)))).prefix_len == 0
    kit.check()
    tree.unlock(receipt)
    kit.check()


def test_failed_allocation_changes_nothing(family: str) -> None:
    """12. A request whose allocation fails leaves sizes, locks and free lists as before."""
    kit = make_tree(family, size=16, page_size=2)
    tree = kit.tree
    kit.put(list(range(8)))

    def state() -> tuple[int, int, int, int, int | None]:
        return (
            tree.evictable_size(),
            tree.protected_size(),
            kit.full.available_size(),
            tree.num_locked,
            kit.mamba.available_size() if kit.mamba else None,
        )

    before = state()
    req = tree.begin_request(RadixKey(list(range(40))), copy_state=True)
    assert kit.full.alloc(40 - req.cached_len) is None  # the pool cannot hold the rest
    tree.abort_request(req)
    assert state() == before
    kit.check()


def test_reset_refused_while_locked_then_frees_everything(family: str) -> None:
    """13. reset refuses while anything is locked; afterwards the tree is empty, slots free."""
    kit = make_tree(family, page_size=2, enable_events=True)
    tree = kit.tree
    kit.put(list(range(8)))
    kit.put([0, 1, 9, 9])
    receipt = tree.lock(tree.match_prefix(RadixKey(list(range(8)))).last_node)
    with pytest.raises(TreeLocked):
        tree.reset()
    assert tree.num_nodes == 3
    tree.unlock(receipt)
    tree.reset()
    assert tree.num_nodes == 0 and tree.evictable_size() == 0
    assert kit.full.available_size() == kit.full.size
    if kit.mamba is not None:
        assert kit.mamba.available_size() == kit.mamba.size
    assert tree.match_prefix(RadixKey(list(range(8)))).prefix_len == 0
    kit.check()


def test_evict_request_validation() -> None:
    kit = make_tree("full")
    with pytest.raises(InvalidEvictRequest):
        EvictRequest(targets={"full": -1})
    with pytest.raises(InvalidEvictRequest):
        kit.tree.evict(EvictRequest(targets={"swa": 4}))
    assert kit.tree.evict(EvictRequest.full(0)).num_evicted() == 0
