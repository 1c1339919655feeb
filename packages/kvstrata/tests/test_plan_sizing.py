"""Sizing the inclusive levels for a target: the rules of `kvstrata.plan.sizing`, exactly."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.plan import (
    COMBINATIONS,
    BlockTrace,
    HitCurve,
    PlanOptionError,
    PlanSpec,
    TargetUnreachable,
    TierPrices,
    lru_curve,
    plan_tiers,
)


def make_curve() -> HitCurve:
    # 10 conversations of 6 turns: turn k repeats turn k-1's blocks and adds one, so the
    # curve climbs with capacity; the longest request has 8 blocks.
    chains = [
        [1000, 2000 + conversation, *(3000 + 10 * conversation + i for i in range(turn + 1))]
        for conversation in range(10)
        for turn in range(6)
    ]
    return lru_curve(BlockTrace.from_chains(chains))


def test_sizes_follow_the_rules() -> None:
    curve = make_curve()
    spec = PlanSpec(target=0.6, device_target=0.2, host_target=0.4, tokens_per_block=16)
    plan = plan_tiers(curve, spec)
    need = {rate: curve.min_capacity(rate) for rate in (0.6, 0.2, 0.4)}
    assert all(v is not None for v in need.values())
    device = max(curve.max_request_blocks, need[0.2] or 0)
    host = max(device, need[0.4] or 0)
    storage = max(host, need[0.6] or 0)
    by_name = {c.combination: c for c in plan.combinations}
    assert tuple(by_name) == COMBINATIONS
    assert [lv.blocks for lv in by_name["device"].levels] == [max(device, storage)]
    assert [lv.blocks for lv in by_name["device+host"].levels] == [device, storage]
    assert [lv.blocks for lv in by_name["device+host+storage"].levels] == [device, host, storage]
    three = by_name["device+host+storage"]
    # Inclusive levels: each serves what its size adds to the faster ones.
    assert [lv.hit_blocks for lv in three.levels] == [
        curve.hit_blocks(device),
        curve.hit_blocks(host) - curve.hit_blocks(device),
        curve.hit_blocks(storage) - curve.hit_blocks(host),
    ]
    assert sum(lv.hit_rate for lv in three.levels) == pytest.approx(three.hit_rate)
    for combination in plan.combinations:
        assert combination.hit_rate >= spec.target
        assert combination.cost is None
        assert [lv.tokens for lv in combination.levels] == [
            16 * lv.blocks for lv in combination.levels
        ]
        assert all(lv.size_bytes is None for lv in combination.levels)
    assert three.levels[0].hit_rate >= 0.2 and three.hit_rate - three.levels[2].hit_rate >= 0.4
    # Without prices the three-level plan keeps the least in the faster levels.
    assert plan.recommended is three


def test_device_holds_at_least_the_longest_request() -> None:
    curve = make_curve()
    plan = plan_tiers(curve, PlanSpec(target=0.1))
    for combination in plan.combinations:
        assert combination.levels[0].blocks >= curve.max_request_blocks


@given(
    target=st.floats(0.01, 0.6),
    device=st.floats(0, 1),
    host=st.floats(0, 1),
    prices=st.tuples(st.floats(0, 100), st.floats(0, 100), st.floats(0, 100)),
)
def test_every_combination_reaches_its_targets_and_the_cheapest_wins(
    target: float, device: float, host: float, prices: tuple[float, float, float]
) -> None:
    curve = make_curve()
    spec = PlanSpec(
        target=target,
        device_target=device * target,
        host_target=host * target,
        bytes_per_token=2,
        tokens_per_block=8,
        prices=TierPrices(device=prices[0], host=prices[1], storage=prices[2]),
    )
    plan = plan_tiers(curve, spec)
    for combination in plan.combinations:
        sizes = [lv.blocks for lv in combination.levels]
        assert sizes == sorted(sizes), "inclusive levels: device <= host <= storage"
        assert combination.hit_rate >= target
        assert combination.levels[0].hit_rate >= spec.device_target
        expected = sum(
            lv.blocks * 16 / 1e9 * spec.prices.of(lv.name)  # type: ignore[union-attr]
            for lv in combination.levels
        )
        assert combination.cost == pytest.approx(expected)
        assert [lv.size_bytes for lv in combination.levels] == [16 * b for b in sizes]
    costs = [c.cost for c in plan.combinations]
    assert plan.recommended.cost == min(costs)
    assert plan.recommended is plan.combinations[costs.index(min(costs))]  # fewer levels on a tie


def test_json_record() -> None:
    curve = make_curve()
    spec = PlanSpec(
        target=0.5,
        bytes_per_token=4,
        tokens_per_block=16,
        prices=TierPrices(device=10, host=1, storage=0.1),
    )
    record = plan_tiers(curve, spec).to_json()
    assert record["recommended"] in COMBINATIONS
    assert record["prices_per_gb"] == {"device": 10, "host": 1, "storage": 0.1}
    combinations = record["combinations"]
    assert isinstance(combinations, list)
    assert [c["combination"] for c in combinations] == list(COMBINATIONS)
    assert [lv["name"] for lv in combinations[2]["levels"]] == ["device", "host", "storage"]


def test_unreachable_target() -> None:
    curve = make_curve()
    with pytest.raises(TargetUnreachable) as info:
        plan_tiers(curve, PlanSpec(target=0.99))
    assert info.value.ideal == curve.ideal_hit_rate
    assert "unbounded cache hits" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": 0.0}, "target hit rate"),
        ({"target": 1.2}, "target hit rate"),
        ({"target": math.nan}, "target hit rate"),
        ({"target": 0.3, "device_target": 0.4}, "device_target"),
        ({"target": 0.3, "host_target": -0.1}, "host_target"),
        ({"target": 0.3, "tokens_per_block": 0}, "tokens_per_block"),
        ({"target": 0.3, "bytes_per_token": 0}, "bytes_per_token"),
        (
            {"target": 0.3, "prices": TierPrices(device=1, host=1, storage=1)},
            "give bytes_per_token",
        ),
    ],
)
def test_bad_spec_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanOptionError, match=message):
        PlanSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_bad_price_is_refused(bad: float) -> None:
    with pytest.raises(PlanOptionError, match="host price"):
        TierPrices(device=1, host=bad, storage=0)
