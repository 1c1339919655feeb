"""Hierarchical mode as ONE tree: host values on the nodes, off-device nodes, revive on insert,
device-leaf eviction, the per-layer load-back handle, and counting each query once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstrata.hybrid_cache import LayerLoadFailed
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import Hierarchy, assert_pages_equal, scramble, snapshot
from kvstrata.unified_radix_cache import (
    BlockRemoved,
    BlockStored,
    FullComponent,
    RadixKey,
    TreeNode,
)
from kvstrata.unified_radix_cache.errors import (
    IntegrityError,
    InvalidInsert,
    NoHostCopy,
    SlotInTree,
)
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 4


def _insert(h: Hierarchy, tokens: list[int]) -> tuple[RadixKey, list[torch.Tensor]]:
    key = RadixKey(tokens)
    slots = h.allocator.alloc(len(tokens))
    assert slots is not None
    result = h.cache.insert(key, slots)
    h.allocator.free(result.duplicates(slots))
    return key, snapshot(h.device_pool, slots)


def _off_device(h: Hierarchy, num_pages: int, *, evict: int) -> tuple[RadixKey, list[torch.Tensor]]:
    """`_insert` tokens 1.. of `num_pages` pages, wait for the host write, then evict `evict`
    device tokens (the host copies stay)."""
    key, expected = _insert(h, list(range(1, num_pages * P + 1)))
    h.cache.drain()
    h.cache.evict_device(evict)
    return key, expected


def _path(h: Hierarchy, key: RadixKey) -> list[TreeNode]:
    node = node_at(h.tree, key)
    assert node is not None
    return list(reversed(list(node.path_to_root())))


def test_host_values_live_on_the_nodes(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy(storage=MemoryStorage(capacity_bytes=1 << 24))
    key, _ = _insert(h, list(range(1, 3 * P + 1)))
    _insert(h, [*range(1, P + 1), 70, 71, 72, 73])  # splits the first node after one page
    h.cache.drain()
    for node in h.tree.iter_nodes():
        value = node.host_value
        assert value is not None and value.dtype == np.int64 and len(value) == node.num_tokens
        assert node.on_device and node.in_storage and node.host_lock_ref == 0
    hosts = np.concatenate([n.host_value for n in _path(h, key) if n.host_value is not None])
    assert len(set(hosts.tolist())) == 3 * P, "distinct host slots along the path"
    assert h.cache.tier.evictable_size == 4 * P and h.cache.tier.protected_size == 0
    h.cache.check_integrity()


def test_device_eviction_keeps_off_device_nodes_and_match_reports_both_hits(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy()
    key, expected = _insert(h, list(range(1, 3 * P + 1)))
    h.cache.drain()
    nodes_before = h.tree.num_nodes
    assert h.cache.evict_device(P) == P  # page-granular: split, the tail goes off the device
    assert h.tree.num_nodes == nodes_before + 1
    head, tail = _path(h, key)
    assert head.on_device and head.num_tokens == 2 * P
    assert not tail.on_device and tail.host_value is not None and tail.num_tokens == P
    full = h.tree.components[0]
    assert isinstance(full, FullComponent) and full.heap is not None
    assert head in full.heap, "a node with only off-device children is a device leaf"
    m = h.cache.match_prefix(key)
    assert (m.device.prefix_len, m.host_hit_len) == (2 * P, P)
    assert m.device.last_node is head and m.device.last_host_node is tail and m.host_node is tail
    assert_pages_equal(
        h.device_pool, m.device.device_indices, [e[: 2 * P] for e in expected], what="head"
    )
    # The rest goes too; every node stays, off the device, held by its host copy.
    assert h.cache.evict_device(8 * P) == 2 * P
    assert h.tree.num_nodes == nodes_before + 1
    assert all(not n.on_device for n in h.tree.iter_nodes())
    assert h.tree.evictable_size() == 0
    h.cache.check_integrity()


def test_device_eviction_without_host_copy_drops_the_tail(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    key, _ = _insert(h, list(range(1, 3 * P + 1)))
    assert h.cache.evict_device(P) == P
    (node,) = _path(h, key[: 2 * P])
    assert node.on_device and node.host_value is None and not node.children
    assert h.tree.num_nodes == 1
    h.cache.check_integrity()


def test_insert_over_off_device_nodes_revives_them(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    key, _ = _off_device(h, 2, evict=2 * P)
    (node,) = _path(h, key)
    assert not node.on_device
    slots = h.allocator.alloc(len(key))
    assert slots is not None
    result = h.cache.insert(key, slots)
    assert result.adopted == ((0, 2 * P),) and result.prefix_len == 2 * P
    assert len(result.duplicates(slots)) == 0, "the tree took every slot back"
    assert node.on_device and torch.equal(torch.from_numpy(node.value), slots)
    assert node.host_value is not None, "the host copy stays"
    assert h.cache.match_prefix(key).device.prefix_len == 2 * P
    h.cache.check_integrity()


def test_insert_refuses_slots_the_tree_holds_before_any_change(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """The Full-only tiered insert (`HostTier.insert_full`): a new leaf's slots and, when the
    key runs over off-device nodes, the slots that would revive them are checked before the
    walk changes anything."""
    h = hierarchy()
    key, _ = _off_device(h, 2, evict=2 * P)
    (node,) = _path(h, key)
    other, _ = _insert(h, list(range(100, 100 + 2 * P)))
    held = torch.from_numpy(_path(h, other)[-1].value.copy())
    nodes = h.tree.num_nodes
    with pytest.raises(SlotInTree):  # a revive would adopt them: the whole key is checked
        h.cache.insert(key, held)
    assert not node.on_device and h.tree.num_nodes == nodes
    with pytest.raises(SlotInTree):  # a new leaf would adopt them
        h.cache.insert(RadixKey(list(range(200, 200 + 2 * P))), held)
    assert h.tree.num_nodes == nodes
    h.cache.check_integrity()
    fresh = h.allocator.alloc(2 * P)
    assert fresh is not None
    assert h.cache.insert(key, fresh).adopted == ((0, 2 * P),) and node.on_device
    h.cache.check_integrity()


def test_a_cached_len_over_off_device_nodes_is_refused_before_any_change(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """`cached_len` says the caller got those slots from this tree: a key whose cached prefix
    reaches an off-device node (which gave out no device slots) is refused with InvalidInsert
    before the walk splits or touches anything (it was a bare assert, after a split)."""
    h = hierarchy()
    key, _ = _off_device(h, 2, evict=2 * P)
    (node,) = _path(h, key)
    nodes, tick = h.tree.num_nodes, node.last_access
    slots = h.allocator.alloc(P)
    assert slots is not None
    with pytest.raises(InvalidInsert, match="cached_len"):
        h.cache.insert(key[:P], slots, cached_len=P)
    assert h.tree.num_nodes == nodes and node.last_access == tick and not node.on_device
    h.allocator.free(slots)
    h.cache.check_integrity()


def test_poll_asks_the_controller_only_when_a_submitted_transfer_is_in_flight(
    hierarchy: Callable[..., Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = hierarchy()
    controller = h.cache.controller
    asked: list[int] = []
    poll_acks = controller.poll_acks
    monkeypatch.setattr(controller, "poll_acks", lambda: asked.append(1) or poll_acks())
    _insert(h, list(range(1, 2 * P + 1)))  # a write queued, not submitted: no ack can come
    assert h.cache.num_pending == 1 and h.cache.core.num_unsent == 1
    h.cache.poll()
    assert not asked
    h.cache.writer.flush()
    assert h.cache.core.num_unsent == 0
    h.cache.poll()  # the submitted write's ack commits
    assert asked == [1] and h.cache.num_pending == 0
    h.cache.check_integrity()
    h.cache.core.num_unsent = 1  # the count drifted from the temporary ids
    with pytest.raises(IntegrityError, match="unsent"):
        h.cache.check_integrity()
    h.cache.core.num_unsent = 0


def test_device_frees_puts_each_node_back_with_the_entry_it_had(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """`HostTier.device_frees` changes nothing, even for a leaf whose policy fields moved since
    its heap entry was made (a re-push would re-key it and the evict would take another leaf
    than the one planned)."""
    h = hierarchy()
    first, _ = _insert(h, list(range(1, 2 * P + 1)))
    _insert(h, list(range(100, 100 + 2 * P)))
    h.cache.drain()
    older = _path(h, first)[-1]
    full = h.tree.components[0]
    assert isinstance(full, FullComponent) and full.heap is not None
    assert full.heap.peek() is older
    older.last_access = h.tree.next_tick()  # touched, not re-keyed (as an inner node is)
    tail = older.value[-P:].tolist()
    planned = np.concatenate(h.cache.tier.device_frees(P))
    assert full.heap.peek() is older, "the walk put the heap back as it was"
    freed: list[torch.Tensor] = []
    free = h.allocator.free
    h.allocator.free = lambda t: (freed.append(t.clone()), free(t))[1]  # type: ignore[method-assign]
    assert h.cache.evict_device(P) == P
    assert planned.tolist() == tail == torch.cat(freed).tolist()
    h.cache.check_integrity()


def test_load_back_handle_waits_per_layer_and_commits_on_the_ack(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy()
    key, expected = _off_device(h, 3, evict=2 * P)
    free = h.allocator.alloc(h.allocator.available_size())
    assert free is not None
    scramble(h.device_pool, free, seed=1)
    h.allocator.free(free)
    m = h.cache.match_prefix(key)
    assert (m.device.prefix_len, m.host_hit_len) == (P, 2 * P)
    load = h.cache.start_load_back(m.host_node)
    assert load.num_tokens == 2 * P and load.op_id is not None and not load.done
    for layer in h.tiers.pools.layer_ids:
        assert load.wait_layer(layer, 10.0)
    # Every layer has arrived, but nothing is committed before the ack is taken.
    assert not m.host_node.on_device
    assert h.cache.num_pending == 1
    h.cache.check_integrity()  # the load's device slots are held outside the tree
    back = load.wait(10.0)
    assert back is not None and load.done and back.loaded_len == 2 * P
    assert m.host_node.on_device and back.match.prefix_len == 3 * P
    assert_pages_equal(h.device_pool, back.match.device_indices, expected, what="layer-wise")
    assert h.cache.num_pending == 0 and h.cache.counters.loaded_tokens == 2 * P
    h.cache.check_integrity()


def test_a_load_committed_by_poll(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    key, expected = _off_device(h, 2, evict=2 * P)
    load = h.cache.start_load_back(h.cache.match_prefix(key).host_node)
    h.cache.drain()  # the ack arrives through the cache: it commits
    assert load.done and load.result is not None and load.result.loaded_len == 2 * P
    assert load.wait() is load.result
    m = h.cache.match_prefix(key)
    assert m.device.prefix_len == 2 * P
    assert_pages_equal(h.device_pool, m.device.device_indices, expected, what="poll")
    h.cache.check_integrity()


def test_a_failed_load_leaves_the_tree_unchanged(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    key, _ = _off_device(h, 2, evict=2 * P)
    (node,) = _path(h, key)
    free_before = h.allocator.available_size()
    group = h.cache.controller.group

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("copy engine fault")

    group.load_pages = broken  # type: ignore[method-assign]  # the tiers' loads
    load = h.cache.start_load_back(node)
    first = h.tiers.pools.layer_ids[0]
    with pytest.raises(LayerLoadFailed):
        load.wait_layer(first, 10.0)
    back = load.wait(10.0)
    assert back is not None and back.loaded_len == 0 and back.match.prefix_len == 0
    assert not node.on_device and node.host_value is not None
    assert h.allocator.available_size() == free_before, "the load's slots were freed"
    assert h.cache.counters.failed_ops == 1 and h.cache.counters.loaded_tokens == 0
    h.cache.check_integrity()


def test_begin_request_counts_a_query_once(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    _insert(h, list(range(1, 3 * P + 1)))
    key = RadixKey(list(range(1, 3 * P + 2)))  # one token more: a request computes at least one
    h.cache.drain()
    h.cache.evict_device(P)
    tree, counters = h.tree, h.cache.counters
    before = (tree.queried_tokens, tree.hit_tokens, tree.host_hit_tokens)
    req = h.cache.begin_request(key)
    assert (req.hit.device_len, req.hit.host_len) == (2 * P, P)
    assert tree.queried_tokens - before[0] == len(key)
    assert tree.hit_tokens - before[1] == 2 * P
    assert tree.host_hit_tokens - before[2] == P
    assert (counters.queried_tokens, counters.device_hit_tokens) == (len(key), 2 * P)
    assert counters.host_hit_tokens == P
    h.tree.abort_request(req)
    h.cache.check_integrity()


def test_check_integrity_catches_a_broken_closure(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy(params=TierParams(write_policy=WritePolicy.WRITE_THROUGH))
    key, _ = _off_device(h, 2, evict=2 * P)
    (node,) = _path(h, key)
    saved = node.host_value
    node.host_value = None  # an off-device node without its host copy
    with pytest.raises(IntegrityError):
        h.cache.check_integrity()
    node.host_value = saved
    h.cache.check_integrity()


def test_host_lock_needs_a_host_copy(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy(write_policy=WritePolicy.WRITE_BACK)
    key, _ = _insert(h, list(range(1, 2 * P + 1)))
    (node,) = _path(h, key)
    with pytest.raises(NoHostCopy):
        h.cache.tier.lock(node)
    assert node.host_lock_ref == 0 and h.cache.tier.num_locked == 0
    h.cache.check_integrity()


def test_device_events_follow_nodes_off_and_back_on_the_device() -> None:
    from kvstrata.allocator import PagedAllocator
    from kvstrata.hybrid_cache import TierController
    from kvstrata.testkit.tiers import make_tiers
    from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, UnifiedRadixCache
    from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache

    tiers = make_tiers("full", page_size=P)
    pool = tiers.pools.members[0].pool
    allocator = PagedAllocator(size=pool.size, page_size=P, device="cpu")
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=P, enable_events=True)
    controller = TierController(tiers.group)
    try:
        cache = HierarchicalCache(
            tree, controller=controller, host_allocator=tiers.hosts["full"].make_allocator()
        )
        key = RadixKey(list(range(1, 2 * P + 1)))
        slots = allocator.alloc(2 * P)
        assert slots is not None
        cache.insert(key, slots)
        cache.drain()
        stored = [(type(e), e.tier) for e in cache.take_events()]
        assert stored == [(BlockStored, "device"), (BlockStored, "host")]
        cache.evict_device(2 * P)
        assert [(type(e), e.tier) for e in cache.take_events()] == [(BlockRemoved, "device")]
        back = cache.load_back(cache.match_prefix(key).host_node)
        assert back.loaded_len == 2 * P
        assert [(type(e), e.tier) for e in cache.take_events()] == [(BlockStored, "device")]
        cache.evict_device(2 * P)
        cache.evict_host(2 * P)
        events = [(type(e), e.tier) for e in cache.take_events()]
        assert events == [(BlockRemoved, "device"), (BlockRemoved, "host")]
        cache.check_integrity()
    finally:
        controller.close()


def test_write_commit_walks_up_from_its_source_even_after_a_split(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """A write commits from its device-locked source node upward (`HostTier.commit_path`): a
    split of that node while the write is in flight leaves the source the node ending at the
    key, and each half gets exactly its slice of the write's host pages; the events are the
    ones the root-down commit emits (root side first)."""
    h = hierarchy()
    key, _ = _insert(h, list(range(1, 3 * P + 1)))
    h.cache.writer.flush()
    other = h.allocator.alloc(2 * P)
    assert other is not None
    h.cache.insert(RadixKey([*range(1, P + 1), 90, 91, 92, 93]), other)
    h.cache.drain()
    head, *rest = _path(h, key)
    assert head.num_tokens == P and sum(n.num_tokens for n in rest) == 2 * P
    whole = np.concatenate([n.host_value for n in _path(h, key) if n.host_value is not None])
    assert len(whole) == 3 * P and len(set(whole.tolist())) == 3 * P
    h.cache.check_integrity(held={"full": P})


def test_commit_path_matches_commit_and_falls_back_off_the_key_end(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """`commit_path` gives the nodes the same host values, receipts and host events as the
    root-down `commit`; a node that does not end at the key takes the root-down commit (same
    result), and pages that meanwhile got a host copy are handed back. With `keep_lock=False`
    (a write no backup follows) both ways release the receipt and lock nothing."""
    results = []
    for mode in ("commit", "path", "fallback", "path-released", "fallback-released"):
        h = hierarchy(host_pages=16)
        key, _ = _insert(h, list(range(1, 3 * P + 1)))
        h.cache.drain()
        h.cache.take_events()
        tier = h.cache.tier
        tail = _path(h, key)[-1]
        # A fourth page on the device only; the host holds the first three.
        longer = RadixKey(list(range(1, 4 * P + 1)))
        slots = h.allocator.alloc(P)
        assert slots is not None
        value = torch.cat([h.tree.prefix_slots(tail), slots])
        result = h.cache.device_tree.insert(longer, value, cached_len=3 * P)
        below = result.last_node
        anchor = tier.host_prefix(below)
        receipt = tier.lock(anchor)
        new = h.cache.host_allocator.alloc(2 * P)  # one page too many: its node has a host copy
        assert new is not None
        free_before = h.cache.host_allocator.available_size()
        source = _path(h, key)[0] if mode.startswith("fallback") else below
        if mode == "commit":
            moved = tier.commit(receipt, longer, new)
        elif mode.endswith("released"):
            assert tier.commit_path(receipt, source, longer, new, keep_lock=False) is None
            assert tier.num_locked == 0
            moved = tier.lock(below)
        else:
            moved = tier.commit_path(receipt, source, longer, new)
        assert moved is not None
        assert moved.anchor is below and below.host_value is not None
        got = [n.host_value.tolist() for n in _path(h, longer) if n.host_value is not None]
        assert h.cache.host_allocator.available_size() == free_before + P
        events = [
            (type(e).__name__, e.page_keys)
            for e in h.cache.take_events()
            if isinstance(e, (BlockStored, BlockRemoved))
        ]
        tier.unlock(moved)
        h.cache.check_integrity()
        results.append((got, events))
    assert all(r == results[0] for r in results)
