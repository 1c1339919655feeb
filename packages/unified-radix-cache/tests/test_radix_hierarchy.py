"""Hierarchical mode: write policies, load-back, host eviction, prefetch, backups, events, faults.

Every device slot of the test pools holds distinct seeded bytes, so a reload checked against a
snapshot taken at insert proves the KV came back bit-identical, page for page.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from kvstrata.hybrid_cache import ControllerParams, PrefetchPolicy
from kvstrata.pool import native
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.pool_host.errors import DoubleFree, SizeNotPageAligned
from kvstrata.pool_host.slots import native_slots
from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage
from kvstrata.testkit.tiers import (
    SHAPES,
    Hierarchy,
    Shape,
    assert_pages_equal,
    scramble,
    scramble_free_device,
    serve,
    snapshot,
)
from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import BlockStored, RadixKey
from kvstrata.unified_radix_cache.errors import ForeignNode, InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache, HostSlots, _TreeHostSlots
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 4


def _run(h: Hierarchy, tokens: list[int]) -> tuple[RadixKey, torch.Tensor, list[torch.Tensor]]:
    """Insert `tokens` with fresh device slots (evicting as needed); returns the key, its slots
    and a snapshot of their KV bytes."""
    key = RadixKey(tokens)
    short = len(tokens) - h.allocator.available_size()
    if short > 0:
        h.cache.evict_device(short)
    slots = h.allocator.alloc(len(tokens))
    assert slots is not None
    result = h.cache.insert(key, slots)
    h.allocator.free(result.duplicates(slots))
    return key, slots, snapshot(h.device_pool, slots)


def _host_total(h: Hierarchy) -> int:
    return h.cache.tier.evictable_size + h.cache.tier.protected_size


def _fill_other(h: Hierarchy, base: int, pages: int) -> None:
    """Insert unrelated prompts until `pages` device pages went through (forces eviction)."""
    for i in range(pages):
        _run(h, [base + 100 * i + j for j in range(P)])


def _reload(h: Hierarchy, key: RadixKey, expected: list[torch.Tensor]) -> None:
    m = h.cache.match_prefix(key)
    assert m.prefix_len == len(key), f"only {m.prefix_len} of {len(key)} found on both tiers"
    if m.host_hit_len:
        back = h.cache.load_back(m.host_node)
        assert back.loaded_len == m.host_hit_len
        match = back.match
    else:
        match = m.device
    assert match.prefix_len == len(key)
    assert_pages_equal(h.device_pool, match.device_indices, expected, what="reload")
    h.cache.check_integrity()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_cycles_keep_kv_bit_identical(
    hierarchy: Callable[..., Hierarchy], policy: WritePolicy
) -> None:
    h = hierarchy(write_policy=policy, device_pages=9, host_pages=24)
    key, _, expected = _run(h, list(range(1, 3 * P + 1)))
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        h.cache.match_prefix(key)
        h.cache.match_prefix(key)  # the second hit queues the host write
    for cycle in range(3):
        h.cache.drain()
        _fill_other(h, 10_000 * (cycle + 1), 8)
        h.cache.drain()
        free = h.allocator.alloc(h.allocator.available_size())
        assert free is not None
        scramble(h.device_pool, free, seed=cycle)  # freed slots get other bytes
        h.allocator.free(free)
        assert h.cache.device_tree.match_prefix(key).prefix_len < len(key), "not evicted"
        _reload(h, key, expected)


def test_write_policies_back_up_when_they_say(hierarchy: Callable[..., Hierarchy]) -> None:
    """BEHAVIOURS 21: write-through on the first hit, selective on the second, write-back only
    on device eviction."""
    tokens = list(range(1, 2 * P + 1))
    for policy, after_insert, after_two_hits in (
        (WritePolicy.WRITE_THROUGH, 2 * P, 2 * P),
        (WritePolicy.WRITE_THROUGH_SELECTIVE, 0, 2 * P),
        (WritePolicy.WRITE_BACK, 0, 0),
    ):
        h = hierarchy(write_policy=policy)
        key, _, _ = _run(h, tokens)
        h.cache.drain()
        assert _host_total(h) == after_insert, policy
        h.cache.match_prefix(key)
        h.cache.match_prefix(key)
        h.cache.drain()
        assert _host_total(h) == after_two_hits, policy
        h.cache.evict_device(2 * P)
        h.cache.drain()
        assert _host_total(h) == 2 * P, policy
        assert h.cache.device_tree.total_size() == 0
        h.cache.check_integrity()


def test_match_reports_host_hit_and_load_back_commits(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    key, _, expected = _run(h, list(range(1, 3 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(P)  # the last page leaves the device, stays on the host
    m = h.cache.match_prefix(key)
    assert (m.device.prefix_len, m.host_hit_len, m.prefix_len) == (2 * P, P, 3 * P)
    assert len(m.host_indices) == P
    m.host_indices.fill_(-1)  # the caller's copy: the tree's host slots are not touched
    h.cache.check_integrity()
    assert (h.cache.match_prefix(key).host_indices >= 0).all()
    back = h.cache.load_back(m.host_node)
    assert back.loaded_len == P and back.match.prefix_len == 3 * P
    assert_pages_equal(h.device_pool, back.match.device_indices, expected, what="load_back")
    assert h.cache.counters.loaded_tokens == P and h.cache.counters.bytes_h2d > 0
    h.cache.check_integrity()
    again = h.cache.load_back(m.device.last_node)  # already on the device: nothing to load
    assert again.loaded_len == 0 and again.match.prefix_len == 2 * P
    with pytest.raises(ForeignNode):
        h.cache.load_back(hierarchy().cache.match_prefix(key).host_node)  # another tree


def test_load_back_without_device_room_keeps_the_shorter_hit(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy(device_pages=5)
    key, _, _ = _run(h, list(range(1, 4 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(4 * P)
    hold = h.allocator.alloc(h.allocator.available_size())  # a running request took it all
    m = h.cache.match_prefix(key)
    assert m.host_hit_len == 4 * P
    back = h.cache.load_back(m.host_node)
    assert back.loaded_len == 0 and back.match.prefix_len == 0
    assert h.cache.counters.load_backs_refused == 1
    h.cache.check_integrity(held={"full": 0 if hold is None else len(hold)})


def test_host_eviction_spares_locked_host_pages(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy(host_pages=4)
    key, _, _ = _run(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(2 * P)  # only copies of what left the device may go
    m = h.cache.match_prefix(key)
    assert m.host_hit_len == 2 * P
    receipt = h.cache.tier.lock(m.host_node)
    assert h.cache.evict_host(4 * P) == 0
    h.cache.tier.unlock(receipt)
    assert h.cache.evict_host(4 * P) == 2 * P
    assert h.cache.counters.host_evicted_tokens == 2 * P
    h.cache.check_integrity()


def test_events_carry_the_tier(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy(storage=MemoryStorage(capacity_bytes=1 << 24), enable_events=True)
    _run(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    events = [e for e in h.cache.take_events() if e.tier != "device"]
    tiers = {e.tier for e in events if isinstance(e, BlockStored)}
    assert tiers == {"host", "storage"}
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].page_keys == stored[1].page_keys, "host and storage name pages alike"
    assert h.cache.take_events() == []
    h.cache.evict_device(2 * P)
    h.cache.evict_host(2 * P)
    removed = [e for e in h.cache.take_events() if e.tier != "device"]
    assert removed and all(e.tier == "host" for e in removed)


@pytest.mark.parametrize("with_storage", [False, True])
def test_no_events_queued_or_hashed_when_the_tree_has_events_off(
    hierarchy: Callable[..., Hierarchy], with_storage: bool
) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24) if with_storage else None
    h = hierarchy(storage=storage)
    key = list(range(1, 2 * P + 1))
    _run(h, key)
    h.cache.drain()
    node = h.cache.match_prefix(RadixKey(key)).device.last_node
    assert node.host_value is not None
    # A host tier alone never hashes a page; storage keys the pages it backs up.
    assert (node.page_keys is not None) == with_storage
    h.cache.evict_device(2 * P)
    h.cache.evict_host(2 * P)
    assert h.cache.evict_host(1) == 0 and h.cache.tier.evicted_total == 2 * P
    h.cache.reset()
    assert h.cache.take_events() == []
    h.cache.check_integrity()


def _prefetch_setup(
    hierarchy: Callable[..., Hierarchy],
    storage: MemoryStorage | FaultInjectingStorage,
    **kw: object,
) -> tuple[Hierarchy, RadixKey, list[torch.Tensor]]:
    """Back a prompt up to storage, then drop it from device and host."""
    params = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    h = hierarchy(storage=storage, params=params, **kw)
    key, _, expected = _run(h, list(range(1, 4 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(4 * P)
    h.cache.evict_host(4 * P)
    assert _host_total(h) == 0 and h.tree.num_nodes == 0
    return h, key, expected


def test_prefetch_from_storage_then_load_back(hierarchy: Callable[..., Hierarchy]) -> None:
    h, key, expected = _prefetch_setup(hierarchy, MemoryStorage(capacity_bytes=1 << 24))
    m = h.cache.match_prefix(key)
    assert m.prefix_len == 0 and m.prefetch_id is not None
    assert h.cache.finish_prefetch(m.prefetch_id) == 4 * P
    assert h.cache.counters.storage_hit_tokens == 4 * P
    h.cache.check_integrity()
    _reload(h, key, expected)


def test_prefetch_probes_one_page_before_hashing_the_rest(
    hierarchy: Callable[..., Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under wait_complete a Full-only tree asks storage for the first page beyond the host
    prefix before it hashes the rest of the key: when storage lacks it no prefetch starts and
    only that page was hashed; when storage holds it the whole prefetch runs as before, the
    rest of the chain going on from the probed key (no page hashed twice), and the nodes it
    adds keep the prefetch's keys: later backups and events hash none of them again."""
    h, key, _ = _prefetch_setup(hierarchy, MemoryStorage(capacity_bytes=1 << 24))
    keyer = h.cache.keyer
    hashed: list[int] = []
    real = keyer.page_keys

    def counted(hash_pages: Callable[..., list[bytes]]) -> Callable[..., list[bytes]]:
        def count(*args: object, **kw: object) -> list[bytes]:
            got = hash_pages(*args, **kw)
            hashed.append(len(got))
            return got

        return count

    # Every page hashed is counted: by the keyer's `page_keys` and by the unchecked chains the
    # tiers hash through (`key_chain.chain_of(keyer)`: the prefetcher's, the host tier's log's).
    for holder, name in (
        (keyer, "page_keys"),
        (h.cache.prefetcher, "_chain"),
        (h.cache.tier._log, "_chain"),
    ):
        monkeypatch.setattr(holder, name, counted(getattr(holder, name)))
    other = RadixKey([1000 + t for t in range(8 * P)])  # never stored
    m = h.cache.match_prefix(other)
    assert m.prefetch_id is None and hashed == [1]
    assert h.cache.counters.prefetches_skipped == 1
    hashed.clear()
    m = h.cache.match_prefix(key)
    assert m.prefetch_id is not None and hashed == [1, 3]
    assert h.cache.finish_prefetch(m.prefetch_id) == 4 * P
    h.cache.check_integrity()
    hashed.clear()
    fresh = real(key.tokens())
    assert h.cache.tier.page_keys(h.cache.match_prefix(key).host_node) == fresh
    assert hashed == []  # the prefetched nodes held their keys


def test_a_prefetch_beyond_a_host_prefix_gives_its_nodes_the_chained_keys(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """A prefetch that starts past a host prefix chains its keys from that prefix's last key;
    the nodes it adds keep exactly the keys the tree would hash for them, and a tree with its
    own events (device tier) names the same pages the same way."""
    h, key, expected = _prefetch_setup(hierarchy, MemoryStorage(capacity_bytes=1 << 24))
    head, _, _ = _run(h, list(range(1, P + 1)))  # page 1 back on the device and the host
    h.cache.drain()
    m = h.cache.match_prefix(key)
    assert m.prefix_len == P and m.prefetch_id is not None
    assert h.cache.finish_prefetch(m.prefetch_id) == 3 * P
    h.cache.check_integrity()
    node = h.cache.match_prefix(key).host_node
    assert node.page_keys is not None and len(node.page_keys) == node.num_tokens // P
    got = h.cache.tier.page_keys(node)
    assert got == h.cache.keyer.page_keys(key.tokens())
    assert got[:1] == h.cache.tier.page_keys(h.cache.match_prefix(head).device.last_node)
    _reload(h, key, expected)


@pytest.mark.parametrize("fault", ["fail", "corrupt", "stall"])
def test_storage_faults_give_a_shorter_hit_never_wrong_kv(
    hierarchy: Callable[..., Hierarchy], fault: str
) -> None:
    inner = MemoryStorage(capacity_bytes=1 << 24)
    storage = FaultInjectingStorage(inner)
    kw: dict[str, object] = {}
    if fault == "stall":
        kw["controller_params"] = ControllerParams(storage_call_timeout_s=0.05)
    h, key, expected = _prefetch_setup(hierarchy, storage, **kw)
    keys = h.cache.keyer.page_keys(key.tokens())
    if fault == "fail":
        storage.set_rules(FaultRules(fail_keys=frozenset({keys[2]})))
    elif fault == "corrupt":
        storage.set_rules(FaultRules(corrupt_keys=frozenset({keys[2]})))
    else:
        storage.set_rules(FaultRules(delay_s=0.2))
    m = h.cache.match_prefix(key)
    assert m.prefetch_id is not None
    got = h.cache.finish_prefetch(m.prefetch_id)
    assert got < 4 * P
    # A failing key reads as absent: the cache's own batch_exists before the prefetch (the
    # request waits for it, wait_complete) already sizes it to the 2 pages there, so it is not
    # short; a corrupt or stalled page is found only by the worker.
    assert h.cache.counters.short_prefetches == (0 if fault == "fail" else 1)
    if fault == "fail":
        # A failing key reads as absent to batch_exists: the chain ends there, no get is tried.
        assert storage.injected_failures >= 1
    else:
        faults = h.cache.controller.metrics_reading().stats.storage_faults
        reason = {"corrupt": "corrupt", "stall": "timeout"}[fault]
        assert {r.value: n for r, n in faults.items()}[reason] >= 1, faults
    if fault != "stall":
        # Pages 0 and 1 come back, the chain ends at the faulty page 2.
        assert got == 2 * P
    h.cache.check_integrity()
    m = h.cache.match_prefix(key)
    assert m.device.prefix_len == 0 and m.host_hit_len == got
    back = h.cache.load_back(m.host_node)
    n = back.match.prefix_len
    assert n == got and back.loaded_len == got
    assert_pages_equal(
        h.device_pool, back.match.device_indices, [e[:n] for e in expected], what=fault
    )


def test_rejects_hybrid_trees_and_mismatched_pages(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    with pytest.raises(InvalidConfig):
        TierParams(host_eviction_policy="nope")
    with pytest.raises(InvalidConfig):
        TierParams(prefetch_threshold=0)
    host = HostSlotAllocator(num_pages=4, page_size=P)
    swa = make_tree("swa", size=64, page_size=P).tree
    with pytest.raises(InvalidConfig, match="component_hosts"):
        HierarchicalCache(swa, controller=h.cache.controller, host_allocator=host)
    with pytest.raises(InvalidConfig, match="members"):
        HierarchicalCache(
            swa,
            controller=h.cache.controller,
            host_allocator=host,
            component_hosts={"swa": HostSlotAllocator(num_pages=4, page_size=P)},
        )
    with pytest.raises(InvalidConfig, match="page size"):
        HierarchicalCache(
            h.tree,
            controller=h.cache.controller,
            host_allocator=HostSlotAllocator(num_pages=4, page_size=2 * P),
        )
    # The transfers hand host slots to the controller unchecked: an allocator must not reach
    # past its host pool.
    too_many = h.cache.controller.group.num_host_pages("full") + 1
    with pytest.raises(InvalidConfig, match="host pool"):
        HierarchicalCache(
            h.tree,
            controller=h.cache.controller,
            host_allocator=HostSlotAllocator(num_pages=too_many, page_size=P),
        )


def test_rejects_allocators_whose_pages_are_not_the_pools_pages(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    """The transfers hand the tree's slots to the controller unchecked (its trusted path), so
    the cache refuses, when built, a tree and host allocator whose pages are not the pools'
    pages (a write of half pages would otherwise move the wrong pages and be acknowledged) or
    a tree whose slots reach past the pool group's device pool."""
    h = hierarchy()
    group = h.cache.controller.group
    host_pages = group.num_host_pages("full")
    half = make_tree("full", size=8 * P, page_size=P // 2).tree
    with pytest.raises(InvalidConfig, match="page size"):
        HierarchicalCache(
            half,
            controller=h.cache.controller,
            host_allocator=HostSlotAllocator(num_pages=host_pages, page_size=P // 2),
        )
    rows = group.member("full").device.num_rows
    wide = make_tree("full", size=rows, page_size=P).tree
    with pytest.raises(InvalidConfig, match="device pool"):
        HierarchicalCache(
            wide,
            controller=h.cache.controller,
            host_allocator=HostSlotAllocator(num_pages=host_pages, page_size=P),
        )
    # What fits is taken (the slots of a smaller tree lie inside the pool).
    small = make_tree("full", size=8 * P, page_size=P).tree
    HierarchicalCache(
        small,
        controller=h.cache.controller,
        host_allocator=HostSlotAllocator(num_pages=host_pages, page_size=P),
    )


def test_host_slots_free_refuses_what_is_not_whole_pages() -> None:
    """`HostSlots` (public) frees as its allocator's `free` does: SizeNotPageAligned for
    indices that are not whole aligned pages, before anything changes."""
    allocator = HostSlotAllocator(num_pages=4, page_size=P)
    sink = HostSlots(allocator)
    taken = allocator.alloc(2 * P)
    assert taken is not None
    free_before = sink.available_size()
    for bad in (taken[1 : P + 1], taken[: P + 1], taken[: P - 1]):
        with pytest.raises(SizeNotPageAligned):
            sink.free(bad.clone())
        assert sink.available_size() == free_before
    sink.free(taken)
    assert sink.available_size() == sink.size
    allocator.check_integrity()


@pytest.mark.parametrize("compiled", [True, False])
def test_tree_host_sink_frees_through_the_compiled_free(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink a HierarchicalCache gives its host tier frees through the allocator's compiled
    `free` when it has one (one checked C call; the page-id path cost three times as much),
    else by page ids; both free the same pages and refuse a double free with nothing changed."""
    if compiled and native_slots() is None:
        pytest.skip("no compiled host slots")
    if compiled:
        allocator = HostSlotAllocator(num_pages=4, page_size=P)
    else:
        with native.disabled():
            allocator = HostSlotAllocator(num_pages=4, page_size=P)
    assert allocator.compiled is compiled
    by_page_id: list[torch.Tensor] = []
    free_pages = allocator.free_pages

    def watched(page_ids: torch.Tensor) -> None:
        by_page_id.append(page_ids)
        free_pages(page_ids)

    monkeypatch.setattr(allocator, "free_pages", watched)
    sink = _TreeHostSlots(allocator)
    taken = allocator.alloc(2 * P)
    assert taken is not None
    sink.free(taken[:P].clone())
    assert sink.available_size() == 3 * P
    with pytest.raises(DoubleFree):
        sink.free(taken.clone())  # its first page is free already
    assert sink.available_size() == 3 * P
    sink.free(taken[P:].clone())
    assert sink.available_size() == sink.size
    allocator.check_integrity()
    assert (len(by_page_id) == 0) is compiled  # the compiled free answered every call


def test_collector_reads_tier_counters(hierarchy: Callable[..., Hierarchy]) -> None:
    from prometheus_client import CollectorRegistry

    from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector

    h, key, _ = _prefetch_setup(hierarchy, MemoryStorage(capacity_bytes=1 << 24))
    m = h.cache.match_prefix(key)
    assert m.prefetch_id is not None
    h.cache.finish_prefetch(m.prefetch_id)
    registry = CollectorRegistry()
    registry.register(TierCacheCollector(h.cache, labels={"instance": "a"}))
    get = registry.get_sample_value
    labels = {"instance": "a"}
    assert get("kvstrata_tiered_cache_hit_tokens_total", {**labels, "tier": "storage"}) == 4 * P
    assert get("kvstrata_tiered_cache_written_tokens_total", labels) == 4 * P
    assert get("kvstrata_tiered_cache_backed_up_tokens_total", labels) == 4 * P
    assert (
        get("kvstrata_tiered_cache_transfer_bytes_total", {**labels, "direction": "storage_get"})
        == h.cache.counters.bytes_storage_get
        > 0
    )
    assert get("kvstrata_tiered_cache_host_tokens", {**labels, "state": "evictable"}) == 4 * P
    h.cache.counters.transfer_timeouts = 3
    assert get("kvstrata_tiered_cache_transfer_timeouts_total", labels) == 3


@pytest.mark.cuda
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_cycles_on_cuda(hierarchy: Callable[..., Hierarchy], policy: WritePolicy) -> None:
    """The same write / evict / load-back cycle with the device pool on CUDA (pinned host
    memory, copy streams): KV comes back bit-identical."""
    h = hierarchy(write_policy=policy, device_pages=9, host_pages=24, device="cuda")
    key, _, expected = _run(h, list(range(1, 3 * P + 1)))
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        h.cache.match_prefix(key)
        h.cache.match_prefix(key)
    h.cache.drain()
    _fill_other(h, 10_000, 8)
    h.cache.drain()
    assert h.cache.device_tree.match_prefix(key).prefix_len < len(key)
    _reload(h, key, expected)


def test_backup_flags_stored_nodes_and_reset_empties_both_tiers(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy(storage=MemoryStorage(capacity_bytes=1 << 24))
    key, _, _ = _run(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    node = h.cache.match_prefix(key).device.last_node
    assert (
        node.in_storage
        and node.host_value is not None
        and h.cache.counters.backed_up_tokens == 2 * P
    )
    h.cache.reset()
    assert h.cache.device_tree.total_size() == 0 and _host_total(h) == 0
    assert h.cache.host_allocator.available_size() == h.cache.host_allocator.size
    h.cache.check_integrity()


def test_prefetch_needs_the_threshold_and_stops_at_the_first_missing_page(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    params = TierParams(prefetch_threshold=3 * P, prefetch_policy=PrefetchPolicy.TIMEOUT)
    h = hierarchy(storage=storage, params=params)
    key, _, expected = _run(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(2 * P)
    h.cache.evict_host(2 * P)
    assert h.cache.match_prefix(key).prefetch_id is None, "2 pages < the 3-page threshold"
    longer = RadixKey(list(range(1, 4 * P + 1)))  # pages 3 and 4 were never stored
    m = h.cache.match_prefix(longer)
    assert m.prefetch_id is not None
    assert h.cache.finish_prefetch(m.prefetch_id) == 2 * P
    # The request waits for it (timeout policy), so the cache asked storage first and sized
    # the prefetch to the 2 stored pages: it is not short, and took no host page for 3 and 4.
    assert h.cache.counters.short_prefetches == 0
    assert h.cache.counters.storage_hit_tokens == 2 * P
    h.cache.check_integrity()
    _reload(h, key, expected)


def test_host_eviction_takes_only_copies_off_the_device(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    from kvstrata.unified_radix_cache.paths import node_at

    h = hierarchy()
    on_device, _, _ = _run(h, list(range(1, 2 * P + 1)))
    h.cache.drain()
    off, _, _ = _run(h, list(range(50, 50 + 2 * P)))
    h.cache.drain()
    h.cache.device_tree.match_prefix(on_device)  # `off` is now the device's LRU leaf
    h.cache.evict_device(2 * P)
    assert h.cache.device_tree.match_prefix(off).prefix_len == 0
    assert h.cache.evict_host(8 * P) == 2 * P, "only the copy of what left the device goes"
    kept = node_at(h.tree, on_device)
    assert kept is not None and kept.on_device and kept.host_value is not None
    assert node_at(h.tree, off) is None, "the off-device node left the tree with its host copy"

    h.cache.check_integrity()


def test_read_only_walks_change_nothing(hierarchy: Callable[..., Hierarchy]) -> None:
    from kvstrata.unified_radix_cache.paths import held_len, key_of, node_at

    h = hierarchy()
    key, _, _ = _run(h, list(range(1, 3 * P + 1)))
    tree = h.cache.device_tree
    leaf = tree.match_prefix(key).last_node
    access, hits, nodes = leaf.last_access, leaf.hit_count, tree.num_nodes
    assert held_len(tree, RadixKey([*range(1, 2 * P + 1), 99, 98, 97, 96])) == 2 * P
    assert held_len(tree, RadixKey(list(range(1, 4 * P + 1)))) == 3 * P
    assert held_len(tree, RadixKey([5, 5, 5, 5])) == 0
    assert node_at(tree, key) is leaf and node_at(tree, key[: 2 * P]) is None
    assert key_of(tree, leaf).token_bytes() == key.token_bytes()
    assert (leaf.last_access, leaf.hit_count, tree.num_nodes) == (access, hits, nodes)
    with pytest.raises(ForeignNode):
        key_of(hierarchy().tree, leaf)


class _GatedStorage(FaultInjectingStorage):
    """Storage whose batch_get signals that it started and waits for the test to release it,
    so a prefetch can be stopped while a storage call is in flight."""

    def __init__(self, inner: MemoryStorage) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.gated = False

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        if self.gated:
            self.entered.set()
            assert self.release.wait(10), "the test never released the gated get"
        return super()._get_into(keys, views)


def test_best_effort_prefetch_commits_late_pages_on_its_ack(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    storage = _GatedStorage(MemoryStorage(capacity_bytes=1 << 24))
    params = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.BEST_EFFORT)
    h = hierarchy(storage=storage, params=params)
    key, _, expected = _run(h, list(range(1, 4 * P + 1)))
    h.cache.drain()
    h.cache.evict_device(4 * P)
    h.cache.evict_host(4 * P)
    storage.gated = True
    m = h.cache.match_prefix(key)
    assert m.prefetch_id is not None
    assert storage.entered.wait(10)
    assert h.cache.finish_prefetch(m.prefetch_id) == 0, "nothing had landed yet"
    seen = h.cache.tier.match_key(key)
    assert seen.prefix_len == 0 and seen.host_hit_len == 0
    h.cache.check_integrity()  # the op still owns its host pages
    storage.release.set()
    h.cache.drain()  # the ack reports the pages that landed after the stop: poll commits them
    assert h.cache.counters.storage_hit_tokens == 4 * P
    h.cache.check_integrity()
    _reload(h, key, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("policy", [WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE])
def test_other_write_policies_bring_hits_back_from_the_host(
    hierarchy: Callable[..., Hierarchy], shape: Shape, policy: WritePolicy
) -> None:
    """write_back (on eviction) and write_through_selective (once a prefix is hit twice) put a
    prefix on the host with everything a hit needs (an SWA model's window, a Mamba model's
    state): after the device lost it and its bytes were overwritten, the hit comes back,
    checked bit for bit by `serve`."""
    h = hierarchy(shape, write_policy=policy)
    a = list(range(1, 3 * P + 1))
    serve(h, [*a, 9, 9, 9, 9])
    for _ in range(2):  # selective: the prefix is written once it is hit the second time
        assert serve(h, [*a, 9, 9, 9, 9, 8, 8, 8, 8]) == len(a) + P
    h.cache.evict_device(h.tree.evictable_size())
    h.cache.drain()
    assert h.tree.evictable_size() == 0
    scramble_free_device(h, seed=7)
    assert serve(h, [*a, 9, 9, 9, 9, 1, 1, 1, 1]) == len(a) + P


@pytest.mark.parametrize("shape", ["swa", "mamba"])
def test_only_boundaries_this_cache_backed_up_are_prefetched(
    hierarchy: Callable[..., Hierarchy], shape: Shape
) -> None:
    """Storage can only say how long a run of keys it holds from the first, so a cache learns
    where stored windows (SWA) or states (Mamba) are from its own backups; another cache over
    the same storage does not know them and starts no prefetch (the pages alone could never be
    a hit)."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    params = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    first, other = (hierarchy(shape, storage=storage, params=params) for _ in range(2))
    a = list(range(1, 3 * P + 1))
    serve(first, a)
    skipped = other.cache.counters.prefetches_skipped
    m = other.cache.match_prefix(RadixKey([*a, 1, 1, 1, 1]))
    assert m.prefetch_id is None and other.cache.counters.prefetches_skipped == skipped + 1
    other.cache.check_integrity()


@pytest.mark.parametrize("namespace", [(None, None), ("lora", None), ("lora", "tenant")])
@pytest.mark.parametrize("head_pages", [0, 2])
@pytest.mark.parametrize("fault", [None, "fail", "corrupt"])
def test_prefetched_nodes_keep_the_keys_of_their_namespace(
    hierarchy: Callable[..., Hierarchy],
    namespace: tuple[str | None, str | None],
    head_pages: int,
    fault: str | None,
) -> None:
    """A prefetch of a key with an adapter and a salt, from the root or past a host prefix,
    whole or cut short by a faulting page: the nodes it adds keep exactly the keys a fresh hash
    of their prefix in that namespace gives, also after later inserts split them."""
    storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 24))
    params = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    h = hierarchy(storage=storage, params=params)
    tokens = list(range(1, 6 * P + 1))
    key = RadixKey(tokens, *namespace)
    fresh = h.cache.keyer.page_keys(key.tokens(), extra_key=namespace[0], cache_salt=namespace[1])
    slots = h.allocator.alloc(len(tokens))
    assert slots is not None
    h.allocator.free(h.cache.insert(key, slots).duplicates(slots))
    h.cache.drain()
    h.cache.evict_device(6 * P)
    h.cache.evict_host(6 * P)
    assert h.tree.num_nodes == 0
    if fault is not None:
        bad = frozenset({h.cache.controller.group.storage_key("full", fresh[4])})
        storage.set_rules(
            FaultRules(fail_keys=bad) if fault == "fail" else FaultRules(corrupt_keys=bad)
        )
    if head_pages:
        head = RadixKey(tokens[: head_pages * P], *namespace)
        slots = h.allocator.alloc(len(head))
        assert slots is not None
        h.allocator.free(h.cache.insert(head, slots).duplicates(slots))
        h.cache.drain()
    m = h.cache.match_prefix(key)
    assert m.prefix_len == head_pages * P and m.prefetch_id is not None
    assert h.cache.finish_prefetch(m.prefetch_id) == (4 if fault else 6) * P - head_pages * P
    h.cache.check_integrity()
    node = h.cache.match_prefix(key).host_node
    assert node.page_keys is not None, "the prefetch handed its keys to the node"
    assert h.cache.tier.page_keys(node) == fresh[: 4 if fault else 6]
    for cut in (3, 1):  # splits of the prefetched nodes keep each part's keys
        other = RadixKey(tokens[: cut * P] + [999 + cut] * P, *namespace)
        slots = h.allocator.alloc(len(other))
        assert slots is not None
        h.allocator.free(h.cache.insert(other, slots).duplicates(slots))
    assert h.cache.tier.page_keys(h.cache.match_prefix(key).host_node) == fresh[: 4 if fault else 6]
    h.cache.check_integrity()
