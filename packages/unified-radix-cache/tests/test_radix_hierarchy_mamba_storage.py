"""Storage (L3) for attention + Mamba models: a backup stores each backed-up node's boundary
state beside the page at that boundary; a prefetch brings the pages up to the deepest boundary
whose state a backup stored, plus that state, and the host hit ends only where the state is
restorable. Round trips through storage are bit-identical (KV and state); a missing or corrupt
state gives a shorter hit, never a wrong one."""

from __future__ import annotations

import pytest

from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.storage import FaultInjectingStorage, FaultRules, MemoryStorage, Storage
from kvstrata.testkit.tiers import MambaHierarchy, make_mamba_hierarchy, scramble, serve_mamba
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
from kvstrata.unified_radix_cache.paths import node_at
from kvstrata.unified_radix_cache.tiers import TierParams


def _host_copy(node: TreeNode) -> ComponentValue:
    """The host copy on `node` of the tree's one component besides Full (index 1)."""
    return None if node.comp_hosts is None else node.comp_hosts[1]


P = 4
PARAMS = TierParams(prefetch_threshold=P, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)


def _build(closing: list[MambaHierarchy], storage: Storage, **kw: object) -> MambaHierarchy:
    kw.setdefault("params", PARAMS)
    h = make_mamba_hierarchy(page_size=P, storage=storage, **kw)  # type: ignore[arg-type]
    closing.append(h)
    return h


def _drop_everything_but_storage(h: MambaHierarchy, seed: int) -> None:
    """Evict every device and host copy, and overwrite the freed device and host bytes: what
    comes back must come from storage."""
    h.cache.evict_device(h.tree.evictable_size())
    h.cache.evict_host(10**6)
    assert h.tree.num_nodes == 0 and h.cache.device_tree.component("mamba").host_held_size == 0
    taken = h.allocator.alloc(h.allocator.available_size())
    assert taken is not None
    scramble(h.device_pool, taken, seed=seed)
    h.allocator.free(taken)
    states = h.states.alloc(h.states.available_size())
    assert states is not None
    scramble(h.mamba_pool, states, seed=seed + 1)
    h.states.free(states)
    for name, pool in h.tiers.hosts.items():
        zeros = bytes(pool.page_size_bytes)
        pages = pool.size // pool.page_size
        for page in range(pages):
            pool.write_page_from(page, zeros)
        assert name in ("full", "mamba")
    h.cache.check_integrity()


def _state_key(h: MambaHierarchy, tokens: list[int]) -> bytes:
    last = h.cache.keyer.page_keys(RadixKey(tokens).tokens())[-1]
    return h.cache.controller.group.storage_key("mamba", last)


def test_backup_stores_the_boundary_state_beside_its_page(
    closing: list[MambaHierarchy],
) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage)
    a = list(range(1, 3 * P + 1))
    serve_mamba(h, a)
    node = node_at(h.tree, RadixKey(a))
    assert node is not None and node.in_storage and _host_copy(node) is not None
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


def test_round_trip_through_storage_is_bit_identical(closing: list[MambaHierarchy]) -> None:
    h = _build(closing, MemoryStorage(capacity_bytes=1 << 24))
    a = list(range(1, 3 * P + 1))
    serve_mamba(h, a)
    for cycle in range(3):
        _drop_everything_but_storage(h, seed=cycle)
        hit = serve_mamba(h, [*a, 7, 7, 7, 7])
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


def test_prefetch_takes_the_deepest_stored_state(closing: list[MambaHierarchy]) -> None:
    storage = MemoryStorage(capacity_bytes=1 << 24)
    h = _build(closing, storage, device_pages=24)
    a = list(range(1, 2 * P + 1))
    b = [*a, *range(50, 50 + 2 * P)]
    serve_mamba(h, a)
    serve_mamba(h, b)  # b's write covers its last 2 pages; its state sits at b's end
    _drop_everything_but_storage(h, seed=1)
    assert serve_mamba(h, [*b, 3, 3, 3, 3]) == len(b)
    # Storage loses b's state: the next prefetch of b finds nothing at its end, forgets that
    # state, and the one after falls back to a's boundary.
    storage.delete([_state_key(h, b)])
    _drop_everything_but_storage(h, seed=2)
    assert serve_mamba(h, [*b, 4, 4, 4, 4]) == 0
    assert h.cache.counters.short_prefetches == 1
    _drop_everything_but_storage(h, seed=3)
    # (the recomputed request stored the state at the end of [*b, 4, 4, 4, 4], not at b's end)
    assert serve_mamba(h, [*b, 5, 5, 5, 5]) == len(a)
    h.cache.check_integrity()


def test_known_stored_states_is_bounded(closing: list[MambaHierarchy]) -> None:
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
    serve_mamba(h, a)
    serve_mamba(h, b)  # remembering b's state forgets a's (the oldest)
    _drop_everything_but_storage(h, seed=6)
    assert serve_mamba(h, [*b, 1, 1, 1, 1]) == len(b)
    assert serve_mamba(h, [*a, 1, 1, 1, 1]) == 0
    h.cache.check_integrity()


def test_only_states_this_cache_backed_up_are_prefetched(
    closing: list[MambaHierarchy],
) -> None:
    """Storage can only say how long a run of keys it holds from the first, so a cache learns
    where stored states are from its own backups; another cache over the same storage does not
    know them and starts no prefetch (the pages alone could never be a hit)."""
    storage = MemoryStorage(capacity_bytes=1 << 24)
    first = _build(closing, storage)
    a = list(range(1, 3 * P + 1))
    serve_mamba(first, a)
    other = _build(closing, storage)
    skipped = other.cache.counters.prefetches_skipped
    m = other.cache.match_prefix(RadixKey([*a, 1, 1, 1, 1]))
    assert m.prefetch_id is None and other.cache.counters.prefetches_skipped == skipped + 1
    other.cache.check_integrity()


@pytest.mark.parametrize("fault", ["corrupt_state", "corrupt_page", "fail_state"])
def test_a_bad_state_or_page_gives_a_shorter_hit(closing: list[MambaHierarchy], fault: str) -> None:
    storage = FaultInjectingStorage(MemoryStorage(capacity_bytes=1 << 24))
    h = _build(closing, storage)
    a = list(range(1, 3 * P + 1))
    serve_mamba(h, a)
    keys = h.cache.keyer.page_keys(RadixKey(a).tokens())
    bad = {
        "corrupt_state": FaultRules(corrupt_keys=frozenset({_state_key(h, a)})),
        "corrupt_page": FaultRules(corrupt_keys=frozenset({keys[1]})),
        "fail_state": FaultRules(fail_keys=frozenset({_state_key(h, a)})),
    }[fault]
    _drop_everything_but_storage(h, seed=5)
    storage.set_rules(bad)
    # Nothing restorable arrives: the request recomputes (serve checks no wrong KV or state).
    assert serve_mamba(h, [*a, 2, 2, 2, 2]) == 0
    assert h.cache.counters.short_prefetches == 1
    assert h.cache.counters.storage_hit_tokens == 0
    h.cache.check_integrity()
