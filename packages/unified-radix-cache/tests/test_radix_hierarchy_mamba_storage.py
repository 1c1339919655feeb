"""Storage (L3) for attention + Mamba models: a backup stores each backed-up node's boundary
state beside the page at that boundary; a prefetch brings the pages up to the deepest boundary
whose state a backup stored, plus that state, and the host hit ends only where the state is
restorable. Round trips through storage are bit-identical (KV and state); a missing or corrupt
state gives a shorter hit, never a wrong one."""

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
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams

P = 4
PARAMS = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)


def _build(closing: list[Hierarchy], storage: Storage, **kw: object) -> Hierarchy:
    kw.setdefault("params", PARAMS)
    h = make_hierarchy("mamba", page_size=P, storage=storage, **kw)  # type: ignore[arg-type]
    closing.append(h)
    return h


def _state_key(h: Hierarchy, tokens: list[int]) -> bytes:
    last = h.cache.keyer.page_keys(RadixKey(tokens).tokens())[-1]
    return h.cache.controller.group.storage_key("mamba", last)


def test_backup_stores_the_boundary_state_beside_its_page(
    closing: list[Hierarchy],
) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage)
    a = list(range(1, 3 * P + 1))
    serve(h, a)
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.in_storage and extra_host_copy(node) is not None
    keys = h.cache.keyer.page_keys(RadixKey(a).tokens())
    assert storage.batch_exists(keys) == 3
    # Only the boundary page carries a state.
    assert storage.batch_exists([_state_key(h, a)]) == 1
    assert storage.batch_exists([_state_key(h, a[: 2 * P])]) == 0
    group = h.cache.controller.group
    counters = h.cache.counters
    assert counters.bytes_storage_set == 3 * group.page_bytes("full") + group.page_bytes("mamba")
    # Step 3: state bytes are counted in the device -> host bytes too.
    assert counters.bytes_d2h == 3 * group.page_bytes("full") + group.page_bytes("mamba")


def test_round_trip_through_storage_is_bit_identical(closing: list[Hierarchy]) -> None:
    h = _build(closing, MemoryStorage(capacity_bytes=1 << 24))
    a = list(range(1, 3 * P + 1))
    serve(h, a)
    for cycle in range(3):
        drop_all_but_storage(h, seed=cycle)
        hit = serve(h, [*a, 7, 7, 7, 7])
        assert hit == len(a)
    counters = h.cache.counters
    assert counters.storage_hit_tokens == 3 * len(a)
    group = h.cache.controller.group
    assert counters.bytes_storage_get == 3 * (
        3 * group.page_bytes("full") + group.page_bytes("mamba")
    )
    # Each cycle loads the prefetched pages and the state back to the device.
    assert counters.bytes_h2d == counters.bytes_storage_get
    h.cache.check_integrity()


def test_prefetch_takes_the_deepest_stored_state(closing: list[Hierarchy]) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage, device_pages=24)
    a = list(range(1, 2 * P + 1))
    b = [*a, *range(50, 50 + 2 * P)]
    serve(h, a)
    serve(h, b)  # b's write covers its last 2 pages; its state sits at b's end
    drop_all_but_storage(h, seed=1)
    assert serve(h, [*b, 3, 3, 3, 3]) == len(b)
    # Storage loses b's state: the next prefetch of b finds nothing at its end, forgets that
    # state, and the one after falls back to a's boundary.
    storage.delete([_state_key(h, b)])
    drop_all_but_storage(h, seed=2)
    assert serve(h, [*b, 4, 4, 4, 4]) == 0
    assert h.cache.counters.short_prefetches == 1
    drop_all_but_storage(h, seed=3)
    # (the recomputed request stored the state at the end of [*b, 4, 4, 4, 4], not at b's end)
    assert serve(h, [*b, 5, 5, 5, 5]) == len(a)
    h.cache.check_integrity()


def test_known_stored_states_is_bounded(closing: list[Hierarchy]) -> None:
    with pytest.raises(InvalidConfig):
        TierParams(known_stored_states=0)
    storage = MemoryStorage(capacity_bytes=1 << 24)
    params = TierParams(
        prefetch_threshold=P,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        known_stored_states=1,
    )
    h = _build(closing, storage, params=params)
    a = list(range(1, 2 * P + 1))
    b = list(range(100, 100 + 2 * P))
    serve(h, a)
    serve(h, b)  # remembering b's state forgets a's (the oldest)
    drop_all_but_storage(h, seed=6)
    assert serve(h, [*b, 1, 1, 1, 1]) == len(b)
    assert serve(h, [*a, 1, 1, 1, 1]) == 0
    h.cache.check_integrity()


@pytest.mark.parametrize("fault", ["corrupt_state", "corrupt_page", "fail_state"])
def test_a_bad_state_or_page_gives_a_shorter_hit(closing: list[Hierarchy], fault: str) -> None:
    storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 24))
    h = _build(closing, storage)
    a = list(range(1, 3 * P + 1))
    serve(h, a)
    keys = h.cache.keyer.page_keys(RadixKey(a).tokens())
    bad = {
        "corrupt_state": FaultRules(corrupt_keys=frozenset({_state_key(h, a)})),
        "corrupt_page": FaultRules(corrupt_keys=frozenset({keys[1]})),
        "fail_state": FaultRules(fail_keys=frozenset({_state_key(h, a)})),
    }[fault]
    drop_all_but_storage(h, seed=5)
    storage.set_rules(bad)
    # Nothing restorable arrives: the request recomputes (serve checks no wrong KV or state).
    assert serve(h, [*a, 2, 2, 2, 2]) == 0
    assert h.cache.counters.short_prefetches == 1
    assert h.cache.counters.storage_hit_tokens == 0
    h.cache.check_integrity()
