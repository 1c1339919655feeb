"""Storage (L3) for hybrid models, where a host hit needs more than the full pages.

Full + sliding-window: a backup stores each backed-up node's full pages and its host SWA pages
where it has them; a prefetch brings the full pages up to the deepest page whose last window's
SWA pages a backup stored, plus those SWA pages, and the host hit ends only where the window is
restorable.

Attention + Mamba: a backup stores each backed-up node's boundary state beside the page at that
boundary; a prefetch brings the pages up to the deepest boundary whose state a backup stored,
plus that state, and the host hit ends only where the state is restorable.

Round trips through storage are bit-identical (KV, SWA KV, state); a missing or corrupt SWA
page or state gives a shorter hit, never a wrong one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage
from kvstrata.testkit.tiers import (
    Hierarchy,
    Shape,
    drop_all_but_storage,
    extra_host_copy,
    serve,
)
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams

P = 4
PARAMS = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
MakeHierarchy = Callable[..., Hierarchy]

# Pages of the prompt the backup, round-trip and fault tests serve, and the pages beside its full
# pages that a hit needs from storage: SWA, the 2 pages of the last window; Mamba, the state.
PROMPT_PAGES: dict[Shape, int] = {"swa": 4, "mamba": 3}
EXTRA_PAGES: dict[Shape, int] = {"swa": 2, "mamba": 1}


def _page_keys(h: Hierarchy, tokens: list[int]) -> list[bytes]:
    return h.cache.keyer.page_keys(RadixKey(tokens).tokens())


def _swa_keys(h: Hierarchy, tokens: list[int]) -> list[bytes]:
    group = h.cache.controller.group
    return [group.storage_key("swa", k) for k in _page_keys(h, tokens)]


def _state_key(h: Hierarchy, tokens: list[int]) -> bytes:
    return h.cache.controller.group.storage_key("mamba", _page_keys(h, tokens)[-1])


def _boundary_key(shape: Shape, h: Hierarchy, tokens: list[int]) -> bytes:
    """The stored key a hit ending at the end of `tokens` cannot do without, besides its full
    pages: the last SWA page of its window, or its state."""
    return _swa_keys(h, tokens)[-1] if shape == "swa" else _state_key(h, tokens)


def _stored_bytes(h: Hierarchy, shape: Shape, num_pages: int) -> int:
    """Bytes one backup (or one prefetch) of a `num_pages`-page prompt moves."""
    group = h.cache.controller.group
    return num_pages * group.page_bytes("full") + EXTRA_PAGES[shape] * group.page_bytes(shape)


# ---- Full + SWA ---------------------------------------------------------------------------


def test_window_before_the_write_is_backed_up_too(hierarchy: MakeHierarchy) -> None:
    """A write whose window reaches back over pages the host (and storage) already had sends
    those pages' SWA pages to storage, so a prefetch can end inside the old part's tail."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = hierarchy("swa", storage=storage, params=PARAMS, device_pages=24)
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


# ---- attention + Mamba --------------------------------------------------------------------


def test_known_stored_states_is_bounded(hierarchy: MakeHierarchy) -> None:
    with pytest.raises(InvalidConfig):
        TierParams(known_stored_states=0)
    storage = MemoryStorage(capacity_bytes=1 << 24)
    params = TierParams(
        prefetch_threshold=P,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        known_stored_states=1,
    )
    h = hierarchy("mamba", storage=storage, params=params)
    a = list(range(1, 2 * P + 1))
    b = list(range(100, 100 + 2 * P))
    serve(h, a)
    serve(h, b)  # remembering b's state forgets a's (the oldest)
    drop_all_but_storage(h, seed=6)
    assert serve(h, [*b, 1, 1, 1, 1]) == len(b)
    assert serve(h, [*a, 1, 1, 1, 1]) == 0
    h.cache.check_integrity()


# ---- both ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["swa", "mamba"])
def test_backup_stores_the_pages_and_what_the_boundary_needs(
    hierarchy: MakeHierarchy, shape: Shape
) -> None:
    """SWA: only the last window (2 pages) has host SWA copies, so only those go to storage.
    Mamba: only the boundary page carries a state."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = hierarchy(shape, storage=storage, params=PARAMS)
    num_pages = PROMPT_PAGES[shape]
    a = list(range(1, num_pages * P + 1))
    serve(h, a)
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.in_storage and extra_host_copy(node) is not None
    assert storage.batch_exists(_page_keys(h, a)) == num_pages
    if shape == "swa":
        swa = _swa_keys(h, a)
        assert storage.batch_exists(swa[2:]) == 2
        assert storage.batch_exists(swa[:1]) == 0 and storage.batch_exists(swa[1:2]) == 0
    else:
        assert storage.batch_exists([_state_key(h, a)]) == 1
        assert storage.batch_exists([_state_key(h, a[: 2 * P])]) == 0
        # Step 3: state bytes are counted in the device -> host bytes too.
        assert h.cache.counters.bytes_d2h == _stored_bytes(h, shape, num_pages)
    assert h.cache.counters.bytes_storage_set == _stored_bytes(h, shape, num_pages)


@pytest.mark.parametrize("shape", ["swa", "mamba"])
def test_round_trip_through_storage_is_bit_identical(
    hierarchy: MakeHierarchy, shape: Shape
) -> None:
    """device -> host -> storage -> (host evicted) -> prefetch -> load back, three times: the
    hit's full KV and its window's SWA KV or its state are the ones computed (serve checks
    every page and the state)."""
    h = hierarchy(shape, storage=MemoryStorage(capacity_bytes=1 << 24), params=PARAMS)
    a = list(range(1, PROMPT_PAGES[shape] * P + 1))
    serve(h, a)
    for cycle in range(3):
        drop_all_but_storage(h, seed=cycle)
        assert serve(h, [*a, 7, 7, 7, 7]) == len(a)
    counters = h.cache.counters
    assert counters.storage_hit_tokens == 3 * len(a)
    assert counters.bytes_storage_get == 3 * _stored_bytes(h, shape, PROMPT_PAGES[shape])
    if shape == "mamba":
        # Each cycle loads the prefetched pages and the state back to the device.
        assert counters.bytes_h2d == counters.bytes_storage_get
    h.cache.check_integrity()


@pytest.mark.parametrize("shape", ["swa", "mamba"])
def test_a_lost_boundary_is_forgotten_and_an_earlier_one_used(
    hierarchy: MakeHierarchy, shape: Shape
) -> None:
    """Storage loses the last SWA page of b's window (b's state): the next prefetch of b gets
    nothing restorable and forgets that boundary; the one after falls back to a's."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = hierarchy(shape, storage=storage, params=PARAMS, device_pages=24)
    a = list(range(1, 2 * P + 1))
    b = [*a, *range(50, 50 + 2 * P)]
    serve(h, a)
    serve(h, b)  # b's write covers its last 2 pages; its window (state) ends at b's end
    drop_all_but_storage(h, seed=1)
    assert serve(h, [*b, 3, 3, 3, 3]) == len(b)
    storage.delete([_boundary_key(shape, h, b)])
    drop_all_but_storage(h, seed=2)
    assert serve(h, [*b, 4, 4, 4, 4]) == 0
    if shape == "mamba":
        assert h.cache.counters.short_prefetches == 1
    drop_all_but_storage(h, seed=3)
    # (the recomputed request stored its boundary at the end of [*b, 4, 4, 4, 4], not at b's)
    assert serve(h, [*b, 5, 5, 5, 5]) == len(a)
    h.cache.check_integrity()


def _bad_rules(fault: str, h: Hierarchy, a: list[int]) -> FaultRules:
    keys = _page_keys(h, a)
    if fault == "corrupt_swa":
        return FaultRules(corrupt_keys=frozenset({_swa_keys(h, a)[3]}))
    if fault == "fail_swa":
        return FaultRules(fail_keys=frozenset({_swa_keys(h, a)[2]}))
    if fault == "corrupt_state":
        return FaultRules(corrupt_keys=frozenset({_state_key(h, a)}))
    if fault == "fail_state":
        return FaultRules(fail_keys=frozenset({_state_key(h, a)}))
    assert fault == "corrupt_full", fault
    return FaultRules(corrupt_keys=frozenset({keys[1]}))


@pytest.mark.parametrize(
    ("shape", "fault"),
    [
        ("swa", "corrupt_swa"),
        ("swa", "fail_swa"),
        ("swa", "corrupt_full"),
        ("mamba", "corrupt_state"),
        ("mamba", "corrupt_full"),
        ("mamba", "fail_state"),
    ],
)
def test_a_bad_boundary_or_full_page_gives_a_shorter_hit(
    hierarchy: MakeHierarchy, shape: Shape, fault: str
) -> None:
    storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 24))
    h = hierarchy(shape, storage=storage, params=PARAMS)
    a = list(range(1, PROMPT_PAGES[shape] * P + 1))
    serve(h, a)
    bad = _bad_rules(fault, h, a)
    drop_all_but_storage(h, seed=5)
    storage.set_rules(bad)
    # Nothing restorable arrives: the request recomputes (serve checks no wrong KV or state).
    assert serve(h, [*a, 2, 2, 2, 2]) == 0
    assert h.cache.counters.short_prefetches == 1
    assert h.cache.counters.storage_hit_tokens == 0
    h.cache.check_integrity()
