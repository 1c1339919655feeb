"""Router policies, approximate mode, and the routing simulation on a small synthetic trace."""

from __future__ import annotations

import pytest

from kvstrata.prefix_index import (
    InvalidParameter,
    NoInstances,
    PrefixIndex,
    Router,
    SimInstance,
    UnknownPolicy,
    simulate,
)

NAMES = ["i0", "i1", "i2"]


def keys_of(index: PrefixIndex, start: int, n: int) -> list[bytes]:
    return index.page_keys(list(range(start, start + n)))


def test_round_robin_and_least_loaded() -> None:
    index = PrefixIndex(1)
    rr = Router(index, NAMES, policy="round_robin")
    assert [rr.route(keys_of(index, 0, 2)).instance for _ in range(4)] == [*NAMES, "i0"]
    ll = Router(index, NAMES, policy="least_loaded")
    first = ll.route(keys_of(index, 0, 5))
    second = ll.route(keys_of(index, 0, 1))
    third = ll.route(keys_of(index, 0, 1))
    assert (first.instance, second.instance, third.instance) == ("i0", "i1", "i2")
    ll.finish(first)
    assert ll.route(keys_of(index, 0, 1)).instance == "i0"


def test_cache_aware_sends_the_second_request_of_a_prefix_to_its_holder() -> None:
    index = PrefixIndex(1)
    instances = {n: SimInstance(n, capacity_pages=100) for n in NAMES}
    router = Router(index, NAMES, policy="cache_aware", load_weight=0.1)
    shared = list(range(1000, 1040))
    warm = router.route(index.page_keys([*shared, 1]))
    instances[warm.instance].serve([*shared, 1])
    index.apply(warm.instance, instances[warm.instance].take_events())
    second = router.route(index.page_keys([*shared, 2]))
    assert second.instance == warm.instance
    assert second.matched_pages == 40
    # A heavy enough load term overrides the hit.
    heavy = Router(index, NAMES, policy="cache_aware", load_weight=10.0)
    heavy.load[warm.instance] = 100
    assert heavy.route(index.page_keys([*shared, 3])).instance != warm.instance


def test_approximate_mode_writes_decisions_with_a_ttl() -> None:
    index = PrefixIndex(1)
    now = [0.0]
    router = Router(index, NAMES, approximate_ttl_s=10.0, clock=lambda: now[0], load_weight=0.0)
    keys = keys_of(index, 0, 8)
    first = router.route(keys)
    assert index.match_lengths(keys) == {first.instance: 8}
    now[0] = 5.0
    again = router.route(keys)
    assert again.instance == first.instance and again.matched_pages == 8
    now[0] = 12.0  # the first write expired, the second (t=5) still holds
    assert index.match_lengths(keys) == {first.instance: 8}
    router.route(keys_of(index, 500, 1))
    assert index.match_lengths(keys) == {first.instance: 8}
    now[0] = 16.0
    router.route(keys_of(index, 600, 1))
    assert index.match_lengths(keys) == {}
    index.check_integrity()


def test_router_errors() -> None:
    index = PrefixIndex(1)
    with pytest.raises(UnknownPolicy):
        Router(index, NAMES, policy="random")
    with pytest.raises(InvalidParameter):
        Router(index, NAMES, load_weight=-1)
    with pytest.raises(InvalidParameter):
        Router(index, NAMES, approximate_ttl_s=0)
    with pytest.raises(InvalidParameter):
        Router(index, ["a", "a"])
    empty = Router(index, [])
    with pytest.raises(NoInstances):
        empty.route([])
    router = Router(index, NAMES)
    router.remove_instance("i1")
    assert router.instances == ["i0", "i2"]


def test_simulation_cache_aware_beats_round_robin() -> None:
    # 61 conversations of 6 turns: each turn extends its conversation's prompt.
    # 61 conversations (not a multiple of 4: round robin is not sticky).
    prompts = [
        [0] + [conv * 1000 + j for j in range(8 * (turn + 1))]
        for turn in range(6)
        for conv in range(61)
    ]
    rr = simulate(prompts, num_instances=4, capacity_pages=400, policy="round_robin")
    ca = simulate(
        prompts, num_instances=4, capacity_pages=400, policy="cache_aware", load_weight=0.05
    )
    assert rr.pages == ca.pages == sum(len(p) for p in prompts)
    assert ca.hit_rate > 2 * rr.hit_rate
    assert ca.max_load_ratio < 1.3
