"""The engine-facing `PrefixCache` protocol: `DeviceCache` (device only) and `HierarchicalCache`
(host tier) driven by one engine loop give the same answers where they must."""

from __future__ import annotations

import pytest
import torch

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy
from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import DeviceCache, PrefixCache, RadixKey
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.tiers import TierParams

P = 4


def _serve(cache: PrefixCache, tokens: list[int], *, state: bool = False) -> tuple[int, int, int]:
    """One request the way an engine runs it (with its own Mamba state when `state`); returns
    the (device, host, storage) hit lengths."""
    req = cache.begin_request(RadixKey(tokens))
    hit = req.hit
    if state and req.state_slot is None:
        req.state_slot = cache.alloc_state()
        assert req.state_slot is not None
    assert req.cached_len == hit.total_len
    new = len(tokens) - req.cached_len
    slots = cache.alloc_tokens(-(-new // P) * P)
    assert slots is not None
    stored = len(tokens) - len(tokens) % P
    tail = slots[stored - req.cached_len :]
    if len(tail):
        cache.release(tail)
    req.extend(slots[: stored - req.cached_len])
    cache.cache_finished_request(req)
    return hit.device_len, hit.host_len, hit.storage_len


def _kit_cache(family: str, size: int) -> tuple[DeviceCache, object]:
    kit = make_tree(family, size=size, page_size=P, mamba_slots=8)
    return DeviceCache(kit.tree, kv_allocator=kit.full, state_allocator=kit.mamba), kit


def test_device_cache_matches_at_most_n_minus_1_and_evicts_to_allocate(family: str) -> None:
    cache, _ = _kit_cache(family, 12 * P)
    a = list(range(1, 4 * P + 1))
    assert _serve(cache, a) == (0, 0, 0)
    # A repeat reuses N - 1 tokens rounded down to a page: 3 pages; the last is recomputed.
    # (Mamba: a state is cached only where the first request ended, 4 pages: no hit at 3.)
    assert _serve(cache, a) == (0 if family == "mamba" else 3 * P, 0, 0)
    # Fill the device past its capacity: allocation evicts instead of failing.
    for start in range(100, 400, 50):
        _serve(cache, list(range(start, start + 4 * P)))
        cache.check_integrity()
    assert cache.evicted_tokens > 0
    assert cache.transfer_counters() is None


def test_device_cache_alloc_none_when_nothing_can_go() -> None:
    cache, _ = _kit_cache("full", 4 * P)
    req = cache.begin_request(RadixKey(list(range(1, 4 * P + 1))))
    slots = cache.alloc_tokens(4 * P)
    assert slots is not None
    req.extend(slots)
    # Everything is held by the running request: nothing evictable, no room.
    assert cache.alloc_tokens(P) is None
    cache.abort_request(req)
    cache.check_integrity()
    assert cache.alloc_tokens(P) is not None


def test_device_cache_state_allocator_is_required_exactly_for_states() -> None:
    mamba = make_tree("mamba", size=8 * P, page_size=P, mamba_slots=4)
    with pytest.raises(InvalidConfig, match="state_allocator"):
        DeviceCache(mamba.tree, kv_allocator=mamba.full)
    full = make_tree("full", size=8 * P, page_size=P)
    with pytest.raises(InvalidConfig, match="state_allocator"):
        DeviceCache(full.tree, kv_allocator=full.full, state_allocator=mamba.mamba)
    cache = DeviceCache(full.tree, kv_allocator=full.full)
    with pytest.raises(InvalidConfig, match="alloc_state"):
        cache.alloc_state()


def test_device_cache_alloc_state_evicts_a_cached_state() -> None:
    cache, _ = _kit_cache("mamba", 64 * P)  # 8 state slots
    for start in range(1, 200, 20):  # 10 requests, each leaving its state in the tree
        _serve(cache, list(range(start, start + 2 * P)), state=True)
        cache.check_integrity()
    mamba = cache.tree.component("mamba")
    assert mamba.evicted_total >= 2 and mamba.free_size() == 0
    slot = cache.alloc_state()
    assert slot is not None and mamba.evicted_total >= 3
    cache.tree.free_slots("mamba", slot)
    cache.check_integrity()


def test_tiered_and_device_caches_answer_one_engine_loop(closing: list[Hierarchy]) -> None:
    """The same loop over both implementations: the tiered cache finds on the host what the
    device-only one lost, and its counters say what moved."""
    h = make_hierarchy(page_size=P, device_pages=9, host_pages=64)
    closing.append(h)
    device, _ = _kit_cache("full", 8 * P)
    first = list(range(1, 4 * P + 2))
    requests = [first] + [list(range(s, s + 4 * P + 1)) for s in (100, 200)] + [first]
    tiered_hits = [_serve(h.cache, r) for r in requests]
    h.cache.drain()
    device_hits = [_serve(device, r) for r in requests]
    h.cache.check_integrity()
    assert device_hits[-1] == (0, 0, 0), "the device-only cache evicted the first prompt"
    assert tiered_hits[-1] == (0, 4 * P, 0), "the tiered cache brings it back from the host"
    counters = h.cache.transfer_counters()
    assert counters.loaded_tokens == 4 * P and counters.bytes_h2d > 0
    req = h.cache.begin_request(RadixKey(first))
    assert req.hit.device_len == 4 * P and req.hit.load is None
    h.cache.abort_request(req)
    h.cache.check_integrity()


def test_tiered_begin_request_hands_out_a_layer_handle(closing: list[Hierarchy]) -> None:
    h = make_hierarchy(page_size=P, device_pages=9, host_pages=64)
    closing.append(h)
    a = list(range(1, 4 * P + 2))
    _serve(h.cache, a)
    h.cache.drain()
    h.cache.evict_device(8 * P)
    req = h.cache.begin_request(RadixKey(a))
    assert req.hit.host_len == 4 * P
    load = req.hit.load
    assert load is not None and load.wait_layer(0, 1.0)
    assert req.receipt is not None
    assert torch.equal(req.kv_indices, h.tree.prefix_slots(req.receipt.anchor))
    h.cache.abort_request(req)
    h.cache.check_integrity()


def test_host_writes_go_out_in_batches(closing: list[Hierarchy]) -> None:
    """write_through queues each finished request's write (host slots and locks taken) and
    submits `write_batch` of them together; a queue that waited that many requests goes too."""
    h = make_hierarchy(
        page_size=P, device_pages=64, host_pages=64, params=TierParams(write_batch=3)
    )
    closing.append(h)
    for i in range(2):
        _serve(h.cache, list(range(100 * i + 1, 100 * i + 2 * P + 2)))
    assert h.cache.num_pending == 2 and h.cache.counters.written_tokens == 0
    assert h.cache.counters.writes_submitted == 0
    assert h.cache.controller.num_pending() == 0, "nothing submitted yet"
    h.cache.check_integrity()  # queued writes hold their host slots and one host lock each
    _serve(h.cache, list(range(201, 201 + 2 * P + 1)))  # the third: the batch goes
    c = h.cache.counters
    assert (c.write_batches, c.writes_submitted) == (1, 3)
    h.cache.drain()
    assert h.cache.counters.written_tokens == 6 * P and h.cache.num_pending == 0
    # One write, then requests that write nothing (repeats: device hits). It waits three
    # requests and goes out at the start of the fourth.
    _serve(h.cache, list(range(301, 301 + 2 * P + 1)))
    for _ in range(3):
        _serve(h.cache, list(range(1, 2 * P + 1)))
        assert (c.write_batches, c.writes_submitted) == (1, 3)
    _serve(h.cache, list(range(1, 2 * P + 1)))
    assert (c.write_batches, c.writes_submitted) == (2, 4)
    h.cache.drain()
    assert h.cache.counters.written_tokens == 8 * P
    h.cache.check_integrity()


def test_write_batch_must_be_positive() -> None:
    with pytest.raises(InvalidConfig, match="write_batch"):
        TierParams(write_batch=0)


@pytest.mark.parametrize(
    ("policy", "started"), [(PrefetchPolicy.WAIT_COMPLETE, 0), (PrefetchPolicy.BEST_EFFORT, 1)]
)
def test_a_waited_prefetch_of_nothing_is_not_started(
    closing: list[Hierarchy], policy: PrefetchPolicy, started: int
) -> None:
    """When the request waits for its prefetch, the cache asks storage first: pages it does not
    hold start no prefetch (no host slots taken, no worker round trip)."""
    params = TierParams(prefetch_threshold=P, prefetch_policy=policy)
    h = make_hierarchy(page_size=P, storage=MemoryStorage(capacity_bytes=1 << 24), params=params)
    closing.append(h)
    m = h.cache.match_prefix(RadixKey(list(range(1, 4 * P + 1))))
    assert (m.prefetch_id is not None) == bool(started)
    assert h.cache.counters.prefetches_started == started
    assert h.cache.counters.prefetches_skipped == 1 - started
    if m.prefetch_id is not None:
        assert h.cache.finish_prefetch(m.prefetch_id) == 0
    h.cache.check_integrity()
