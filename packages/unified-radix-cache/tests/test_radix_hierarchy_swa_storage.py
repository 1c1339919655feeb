"""Storage (L3) for full + sliding-window models: a backup stores each backed-up node's full
pages and its host SWA pages where it has them; a prefetch brings the full pages up to the
deepest page whose last window's SWA pages a backup stored, plus those SWA pages, and the host
hit ends only where the window is restorable. Round trips through storage are bit-identical
(full and SWA KV); a missing or corrupt SWA page gives a shorter hit, never wrong KV."""

from __future__ import annotations

import pytest

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage, Storage
from kvstrata.testkit.tiers import (
    Hierarchy,
    drop_all_but_storage,
    extra_host_copy,
    make_hierarchy,
    serve,
)
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams

P = 4
PARAMS = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)


def _build(closing: list[Hierarchy], storage: Storage, **kw: object) -> Hierarchy:
    kw.setdefault("params", PARAMS)
    h = make_hierarchy("swa", page_size=P, storage=storage, **kw)  # type: ignore[arg-type]
    closing.append(h)
    return h


def _swa_keys(h: Hierarchy, tokens: list[int]) -> list[bytes]:
    group = h.cache.controller.group
    keys = h.cache.keyer.page_keys(RadixKey(tokens).tokens())
    return [group.storage_key("swa", k) for k in keys]


def test_backup_stores_the_window_swa_pages(closing: list[Hierarchy]) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage)
    a = list(range(1, 4 * P + 1))
    serve(h, a)
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.in_storage and extra_host_copy(node) is not None
    keys = h.cache.keyer.page_keys(RadixKey(a).tokens())
    assert storage.batch_exists(keys) == 4
    swa = _swa_keys(h, a)
    # Only the last window (2 pages) has host SWA copies, so only those go to storage.
    assert storage.batch_exists(swa[2:]) == 2
    assert storage.batch_exists(swa[:1]) == 0 and storage.batch_exists(swa[1:2]) == 0
    group = h.cache.controller.group
    assert h.cache.counters.bytes_storage_set == 4 * group.page_bytes("full") + 2 * (
        group.page_bytes("swa")
    )


def test_round_trip_through_storage_is_bit_identical(closing: list[Hierarchy]) -> None:
    """device -> host -> storage -> (host evicted) -> prefetch -> load back, three times: the
    hit's full KV and its window's SWA KV are the ones computed (serve checks every page)."""
    h = _build(closing, MemoryStorage(capacity_bytes=1 << 24))
    a = list(range(1, 4 * P + 1))
    serve(h, a)
    for cycle in range(3):
        drop_all_but_storage(h, seed=cycle)
        assert serve(h, [*a, 7, 7, 7, 7]) == len(a)
    counters = h.cache.counters
    assert counters.storage_hit_tokens == 3 * len(a)
    group = h.cache.controller.group
    assert counters.bytes_storage_get == 3 * (
        4 * group.page_bytes("full") + 2 * group.page_bytes("swa")
    )
    h.cache.check_integrity()


def test_window_before_the_write_is_backed_up_too(closing: list[Hierarchy]) -> None:
    """A write whose window reaches back over pages the host (and storage) already had sends
    those pages' SWA pages to storage, so a prefetch can end inside the old part's tail."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage, device_pages=24)
    a = list(range(1, 3 * P + 1))
    b = [*a, *range(50, 50 + P)]  # one new page: its window is a's last page + its own
    serve(h, a)
    events_before = h.cache.counters.backed_up_tokens
    serve(h, b)
    assert h.cache.counters.backed_up_tokens - events_before == P  # only b's page is new
    swa = _swa_keys(h, b)
    assert storage.batch_exists(swa[2:]) == 2
    drop_all_but_storage(h, seed=4)
    assert serve(h, [*b, 9, 9, 9, 9]) == len(b)
    h.cache.check_integrity()


@pytest.mark.parametrize("fault", ["corrupt_swa", "fail_swa", "corrupt_full"])
def test_a_bad_swa_or_full_page_gives_a_shorter_hit(closing: list[Hierarchy], fault: str) -> None:
    storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 24))
    h = _build(closing, storage)
    a = list(range(1, 4 * P + 1))
    serve(h, a)
    swa = _swa_keys(h, a)
    keys = h.cache.keyer.page_keys(RadixKey(a).tokens())
    bad = {
        "corrupt_swa": FaultRules(corrupt_keys=frozenset({swa[3]})),
        "fail_swa": FaultRules(fail_keys=frozenset({swa[2]})),
        "corrupt_full": FaultRules(corrupt_keys=frozenset({keys[1]})),
    }[fault]
    drop_all_but_storage(h, seed=5)
    storage.set_rules(bad)
    # Nothing restorable arrives: the request recomputes (serve checks no wrong KV).
    assert serve(h, [*a, 2, 2, 2, 2]) == 0
    assert h.cache.counters.short_prefetches == 1
    assert h.cache.counters.storage_hit_tokens == 0
    h.cache.check_integrity()


def test_a_lost_window_is_forgotten_and_an_earlier_one_used(
    closing: list[Hierarchy],
) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage, device_pages=24)
    a = list(range(1, 2 * P + 1))
    b = [*a, *range(50, 50 + 2 * P)]
    serve(h, a)
    serve(h, b)
    drop_all_but_storage(h, seed=1)
    assert serve(h, [*b, 3, 3, 3, 3]) == len(b)
    # Storage loses b's last SWA page: the next prefetch of b gets nothing restorable and
    # forgets that window; the one after falls back to a's window.
    storage.delete([_swa_keys(h, b)[-1]])
    drop_all_but_storage(h, seed=2)
    assert serve(h, [*b, 4, 4, 4, 4]) == 0
    drop_all_but_storage(h, seed=3)
    assert serve(h, [*b, 5, 5, 5, 5]) == len(a)
    h.cache.check_integrity()
