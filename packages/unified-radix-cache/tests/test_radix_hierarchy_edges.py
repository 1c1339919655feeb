"""Hierarchical mode at its edges: slow writes during eviction and load-back (no lock leaks, no
unsaved leaf dropped), prefetches committed by another call's poll, where a prefetch starts,
one hit per node per request, and the integrity checks that catch a slot held twice."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvstrata.hybrid_cache import Ack, AckStatus, OpKind, PrefetchPolicy
from kvstrata.storage import MemoryStorage
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, serve
from kvstrata.unified_radix_cache import RadixKey, SWAComponent, TreeNode
from kvstrata.unified_radix_cache.errors import ForeignNode, IntegrityError
from kvstrata.unified_radix_cache.host_tier import HostReceipt
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tier_core import PendingBackup
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

P = 4


def _insert(h: Hierarchy, key: RadixKey) -> None:
    slots = h.allocator.alloc(len(key))
    assert slots is not None
    result = h.cache.insert(key, slots)
    h.allocator.free(result.duplicates(slots))


def _host_only(h: Hierarchy) -> tuple[RadixKey, TreeNode]:
    """Insert three pages, write them to the host and evict them from the device: returns the
    key and the host node a match stops at."""
    key = RadixKey(list(range(1, 3 * P + 1)))
    _insert(h, key)
    h.cache.drain()
    h.cache.evict_device(3 * P)
    match = h.cache.match_prefix(key)
    assert match.host_node is not None and match.host_hit_len == 3 * P
    return key, match.host_node


@pytest.fixture
def host_only(hierarchy: Callable[..., Hierarchy]) -> tuple[Hierarchy, RadixKey, TreeNode]:
    """A default hierarchy after `_host_only`: it, the key and the host node."""
    h = hierarchy()
    key, node = _host_only(h)
    return h, key, node


def _two_prefixes(h: Hierarchy) -> tuple[RadixKey, RadixKey]:
    """Insert two unrelated two-page prefixes (tokens from 1 and from 500); their keys."""
    a = RadixKey(list(range(1, 2 * P + 1)))
    b = RadixKey(list(range(500, 500 + 2 * P)))
    _insert(h, a)
    _insert(h, b)
    return a, b


def _stall_acks(h: Hierarchy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every transfer look slow: waits time out, polls see nothing."""

    def no_ack(op_id: int, timeout_s: float | None = None) -> Ack | None:
        return None

    monkeypatch.setattr(h.cache.controller, "wait", no_ack)
    monkeypatch.setattr(h.cache.controller, "poll_acks", list)


def _settle(h: Hierarchy) -> None:
    """Poll (never wait) until every transfer in flight has committed."""
    deadline = time.monotonic() + 10.0
    while h.cache.num_pending and time.monotonic() < deadline:
        h.cache.poll()
        time.sleep(0.005)
    assert h.cache.num_pending == 0, "transfers still in flight after 10 s"


def test_load_back_behind_a_slow_write_is_refused_and_leaks_no_lock(
    hierarchy: Callable[..., Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = hierarchy(device_pages=9, host_pages=32)
    c = h.cache
    _, host_node = _host_only(h)
    b = RadixKey([100 + i for i in range(h.allocator.available_size())])
    with monkeypatch.context() as m:
        _stall_acks(h, m)
        _insert(h, b)  # its write_through write stays in flight and device-locks b
        load = c.start_load_back(host_node)  # no TimeoutError: refused, no room
        assert load.done and load.num_tokens == 0
        assert c.counters.load_backs_refused == 1
    c.drain()
    assert c.device_tree.num_locked == 0
    assert c.tier.num_locked == 0
    c.check_integrity()
    node = node_at(h.tree, b)
    assert node is not None and len(node.value), "the slow write's source stayed on the device"


def test_load_back_releases_both_locks_when_allocation_raises(
    host_only: tuple[Hierarchy, RadixKey, TreeNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, _, host_node = host_only
    c = h.cache

    def broken(num_tokens: int) -> object:
        raise RuntimeError("allocator broke")

    with monkeypatch.context() as m:
        m.setattr(c.room, "alloc", broken)
        with pytest.raises(RuntimeError, match="allocator broke"):
            c.start_load_back(host_node)
    assert c.device_tree.num_locked == 0
    assert c.tier.num_locked == 0
    c.check_integrity()


def test_write_back_eviction_stops_at_a_slow_write(
    hierarchy: Callable[..., Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = hierarchy(
        write_policy=WritePolicy.WRITE_BACK,
        params=TierParams(write_policy=WritePolicy.WRITE_BACK),
    )
    c = h.cache
    a, b = _two_prefixes(h)
    with monkeypatch.context() as m:
        _stall_acks(h, m)
        freed = c.evict_device(4 * P)  # a's write times out: nothing unsaved may go
    assert freed == 0
    for key in (a, b):
        node = node_at(h.tree, key)
        assert node is not None and len(node.value), "an unsaved leaf left the device"
    c.drain()  # the late ack commits a's host copy
    c.check_integrity()
    assert c.evict_device(4 * P) == 4 * P
    c.drain()
    for key in (a, b):
        assert c.match_prefix(key).host_hit_len == 2 * P, "evicted leaves kept a host copy"
    c.check_integrity()


def _storage_only(h: Hierarchy, key: RadixKey) -> None:
    _insert(h, key)
    h.cache.drain()
    h.cache.evict_device(len(key))
    h.cache.drain()
    h.cache.evict_host(len(key))
    h.cache.drain()
    assert h.cache.device_tree.num_nodes == 0


def test_finish_prefetch_returns_what_another_poll_committed(
    hierarchy: Callable[..., Hierarchy],
) -> None:
    h = hierarchy(
        storage=MemoryStorage(capacity_bytes=1 << 24),
        params=TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.BEST_EFFORT),
    )
    c = h.cache
    key = RadixKey(list(range(1, 4 * P + 1)))
    _storage_only(h, key)
    m = c.match_prefix(key)
    assert m.prefetch_id is not None
    _settle(h)  # another call's poll commits the prefetch
    assert c.finish_prefetch(m.prefetch_id) == 4 * P
    with pytest.raises(ForeignNode):
        c.finish_prefetch(m.prefetch_id)  # taken: the record is gone
    with pytest.raises(ForeignNode):
        c.finish_prefetch(10_000)
    assert c.match_prefix(key).host_hit_len == 4 * P
    c.check_integrity()


@pytest.mark.parametrize(
    "policy", [WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE], ids=lambda p: p.value
)
def test_prefetch_fetches_only_pages_beyond_the_device_hit(
    hierarchy: Callable[..., Hierarchy], policy: WritePolicy
) -> None:
    h = hierarchy(
        write_policy=policy,
        storage=MemoryStorage(capacity_bytes=1 << 24),
        params=TierParams(
            write_policy=policy,
            prefetch_threshold=P,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        ),
    )
    c = h.cache
    key = RadixKey(list(range(1, 8 * P + 1)))
    if policy is WritePolicy.WRITE_BACK:
        _insert(h, key)
        c.evict_device(8 * P)  # written back, then backed up
        c.drain()
        c.evict_host(8 * P)
        c.drain()
    else:
        _insert(h, key)
        c.match_prefix(key)
        c.match_prefix(key)  # second hit: written, then backed up
        c.drain()
        c.evict_device(8 * P)
        c.drain()
        c.evict_host(8 * P)
        c.drain()
    assert c.device_tree.num_nodes == 0
    _insert(h, key[: 6 * P])  # device only, no host copy
    m = c.match_prefix(key)
    assert m.device.prefix_len == 6 * P and m.host_hit_len == 0
    got = c.finish_prefetch(m.prefetch_id) if m.prefetch_id is not None else 0
    c.drain()
    assert c.counters.storage_hit_tokens == got
    assert got in (0, 2 * P), "only the pages beyond the device hit may come from storage"
    if not got:
        m = c.match_prefix(key)  # the device part has a host copy now
        assert m.prefetch_id is not None
        got = c.finish_prefetch(m.prefetch_id)
    assert got == 2 * P
    assert c.counters.storage_hit_tokens == 2 * P
    assert c.counters.bytes_storage_get == 2 * c.controller.group.page_bytes("full")
    assert c.match_prefix(key).prefix_len == 8 * P
    c.check_integrity()


def test_a_request_counts_one_hit_per_node(hierarchy: Callable[..., Hierarchy]) -> None:
    h = hierarchy()
    c = h.cache
    key = RadixKey(list(range(1, 3 * P + 1)))
    _insert(h, key)
    c.drain()
    query = RadixKey(list(range(1, 3 * P + 2)))
    node = node_at(h.tree, key)
    assert node is not None
    before = node.hit_count
    t = c.begin_request(query)
    h.tree.abort_request(t)
    assert node.hit_count - before == 1
    c.evict_device(3 * P)
    before = node.hit_count
    t = c.begin_request(query)
    assert t.hit.host_len == 3 * P
    h.tree.abort_request(t)
    assert node.hit_count - before == 1
    c.check_integrity()


def test_a_timed_out_load_back_is_no_failure_when_its_late_ack_commits(
    host_only: tuple[Hierarchy, RadixKey, TreeNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, key, host_node = host_only
    c = h.cache
    with monkeypatch.context() as m:
        _stall_acks(h, m)
        back = c.load_back(host_node)
    assert back.loaded_len == 0
    assert c.counters.transfer_timeouts == 1
    c.drain()  # the late ack commits the load
    assert c.counters.failed_ops == 0
    assert c.counters.loaded_tokens == 3 * P
    assert c.match_prefix(key).device.prefix_len == 3 * P
    c.check_integrity()


def test_integrity_sees_a_host_slot_held_twice_and_a_foreign_receipt(
    hierarchy: Callable[..., Hierarchy], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = hierarchy()
    c = h.cache
    a, b = _two_prefixes(h)
    c.drain()
    c.check_integrity()
    node_a, node_b = node_at(h.tree, a), node_at(h.tree, b)
    assert node_a is not None and node_b is not None
    assert node_a.host_value is not None and node_b.host_value is not None
    own = node_b.host_value
    node_b.host_value = node_a.host_value.copy()  # same counts, one slot held twice
    with pytest.raises(IntegrityError, match="held twice"):
        c.check_integrity()
    node_b.host_value = own
    c.check_integrity()
    with monkeypatch.context() as m:
        _stall_acks(h, m)
        _insert(h, RadixKey(list(range(900, 900 + 2 * P))))  # a write stays in flight
        (pending,) = c.core.pending.values()
        real = pending.host_receipt
        pending.host_receipt = HostReceipt(receipt_id=real.receipt_id + 1000, anchor=real.anchor)
        with pytest.raises(IntegrityError, match="host receipts"):
            c.check_integrity()
        pending.host_receipt = real
    c.drain()
    c.check_integrity()


def test_a_backup_remembers_only_the_last_windows_swa_pages() -> None:
    # The WINDOW restore rule acknowledges `done` pages when the SWA pages of the last window
    # before `done` are stored; SWA pages before that window may have failed.
    h = make_hierarchy("swa", page_size=P)
    try:
        c = h.cache
        tokens = list(range(1, 4 * P + 1))
        serve(h, tokens)
        c.drain()
        node = node_at(h.tree, RadixKey(tokens))
        assert node is not None
        keys = c.tier.page_keys(node)
        assert len(keys) == 4
        pending = PendingBackup(
            host_receipt=c.tier.lock(node),
            keys=keys,
            parent_key=None,
            key=RadixKey(tokens),
            comp_pages=(("swa", (0, 1, 2, 3)),),
        )
        ack = Ack(
            op_id=10_000, kind=OpKind.BACKUP, status=AckStatus.DONE, num_pages=4, num_pages_done=4
        )
        c.writer.commit_backup(pending, ack)
        swa = h.cache.device_tree.component("swa")
        assert isinstance(swa, SWAComponent)
        window = -(-swa.sliding_window // P)
        assert list(c.core.stored_states) == keys[4 - window :]
        c.check_integrity()
    finally:
        h.cache.controller.close()
