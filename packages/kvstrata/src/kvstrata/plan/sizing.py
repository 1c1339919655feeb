"""Sizes of the device, host and storage levels for a target hit rate, read off one LRU curve.

The levels are inclusive LRU caches over one recency order: a block on the device has a copy on
the host, a block on the host has one in storage (write-through, as kvstrata's tiers back up
device pages), so with sizes D <= H <= S (blocks) each level holds the top D, H, S blocks of the
same stack and

    device hits  = hits(D)              host hits = hits(H) - hits(D)
    storage hits = hits(S) - hits(H)    together  = hits(S)        (hits: `HitCurve.hit_blocks`)

The combined hit rate depends on the largest level only, so the target alone would put every
block in the cheapest level. What keeps blocks in the faster levels is the share each must
serve by itself: `device_target` (device hits) and `host_target` (device + host hits). Sizes:

    D = max(longest request, C(device_target))   the device must hold the request it runs
    H = max(D, C(host_target))
    S = max(H, C(target))                        C(x): the smallest capacity reaching hit rate x

and the three combinations an operator can deploy are

    device                  device D' = max(D, C(target))
    device + host           device D, host H' = max(H, C(target))
    device + host + storage device D, host H, storage S

With per-tier prices (per GB) and the model's bytes per token, each combination gets a cost
(every level pays for all its blocks, copies included) and the cheapest is recommended (the one
with fewer levels on a tie); without prices, the three-level combination is, which keeps the
least in the faster levels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvstrata.plan.curve import HitCurve
from kvstrata.plan.errors import PlanOptionError, TargetUnreachable

#: The deployable combinations, fewest levels first.
COMBINATIONS: tuple[str, ...] = ("device", "device+host", "device+host+storage")

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class TierPrices:
    """Price of a GB (10^9 bytes) in each level, in any one currency."""

    device: float
    host: float
    storage: float

    def __post_init__(self) -> None:
        for name in ("device", "host", "storage"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise PlanOptionError(f"the {name} price must be a finite number >= 0, got {value}")

    def of(self, level: str) -> float:
        return {"device": self.device, "host": self.host, "storage": self.storage}[level]


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """What the plan must reach and how to count bytes and money.

    `target`: combined hit rate (0 < target <= 1); `device_target` / `host_target`: the hit
    rate the device alone / device and host together must serve (default 0: the device only
    holds the running request, the host only stages it). `tokens_per_block`: tokens a trace block
    stands for (512 in the Mooncake traces); `bytes_per_token`: the model's KV bytes per token
    (all layers), needed for bytes and for `prices`."""

    target: float
    device_target: float = 0.0
    host_target: float = 0.0
    tokens_per_block: int = 512
    bytes_per_token: int | None = None
    prices: TierPrices | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise PlanOptionError(f"the target hit rate must be in (0, 1], got {self.target}")
        for name in ("device_target", "host_target"):
            value = getattr(self, name)
            if not 0.0 <= value <= self.target:
                raise PlanOptionError(
                    f"{name} must be between 0 and the target {self.target}, got {value}"
                )
        if self.tokens_per_block < 1:
            raise PlanOptionError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.bytes_per_token is not None and self.bytes_per_token < 1:
            raise PlanOptionError(f"bytes_per_token must be >= 1, got {self.bytes_per_token}")
        if self.prices is not None and self.bytes_per_token is None:
            raise PlanOptionError("prices are per GB: give bytes_per_token as well")

    @property
    def bytes_per_block(self) -> int | None:
        if self.bytes_per_token is None:
            return None
        return self.bytes_per_token * self.tokens_per_block


@dataclass(frozen=True, kw_only=True)
class LevelPlan:
    """One level of a combination: its size, the hits it serves itself, and its cost."""

    name: str
    blocks: int
    tokens: int
    size_bytes: int | None
    hit_blocks: int
    hit_rate: float
    cost: float | None

    def to_json(self) -> dict[str, object]:
        """Every field, the rate and the cost rounded to 6 places."""
        return {**asdict(self), "hit_rate": round(self.hit_rate, 6), "cost": _round(self.cost)}


@dataclass(frozen=True, kw_only=True)
class CombinationPlan:
    """One deployable combination of levels, sized for the spec."""

    combination: str
    levels: tuple[LevelPlan, ...]
    hit_rate: float
    cost: float | None

    def level(self, name: str) -> LevelPlan | None:
        return next((lv for lv in self.levels if lv.name == name), None)

    def to_json(self) -> dict[str, object]:
        return {
            "combination": self.combination,
            "hit_rate": round(self.hit_rate, 6),
            "cost": _round(self.cost),
            "levels": [lv.to_json() for lv in self.levels],
        }


@dataclass(frozen=True, kw_only=True)
class TierPlan:
    """Every combination for one spec, and the recommended one."""

    spec: PlanSpec
    combinations: tuple[CombinationPlan, ...]
    recommended: CombinationPlan

    def to_json(self) -> dict[str, object]:
        """The spec's fields (its prices as `prices_per_gb`, per level or None), the recommended
        combination's name and every combination with its levels."""
        record: dict[str, object] = asdict(self.spec)
        record["prices_per_gb"] = record.pop("prices")
        record["recommended"] = self.recommended.combination
        record["combinations"] = [c.to_json() for c in self.combinations]
        return record


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def plan_tiers(curve: HitCurve, spec: PlanSpec) -> TierPlan:
    """Size every combination for `spec` on `curve` (see the module doc) and pick one.

    Raises TargetUnreachable when a target is above the curve's ideal hit rate. Pure."""
    need = {
        name: _capacity(curve, name, rate)
        for name, rate in (
            ("target", spec.target),
            ("device_target", spec.device_target),
            ("host_target", spec.host_target),
        )
    }
    device = max(curve.max_request_blocks, need["device_target"])
    host = max(device, need["host_target"])
    storage = max(host, need["target"])
    sizes = {
        "device": (("device", max(device, need["target"])),),
        "device+host": (("device", device), ("host", max(host, need["target"]))),
        "device+host+storage": (("device", device), ("host", host), ("storage", storage)),
    }
    combinations = tuple(_combination(curve, spec, name, sizes[name]) for name in COMBINATIONS)
    if spec.prices is None:
        recommended = combinations[-1]
    else:
        # min() keeps the first of equal costs: the one with fewer levels.
        recommended = min(combinations, key=lambda c: c.cost if c.cost is not None else math.inf)
    return TierPlan(spec=spec, combinations=combinations, recommended=recommended)


def _capacity(curve: HitCurve, name: str, rate: float) -> int:
    capacity = curve.min_capacity(rate)
    if capacity is None:
        raise TargetUnreachable(name=name, target=rate, ideal=curve.ideal_hit_rate)
    return capacity


def _combination(
    curve: HitCurve, spec: PlanSpec, name: str, sizes: tuple[tuple[str, int], ...]
) -> CombinationPlan:
    per_block = spec.bytes_per_block
    levels: list[LevelPlan] = []
    above = 0  # hits served by the faster levels
    for level, blocks in sizes:
        hits = curve.hit_blocks(blocks)
        size_bytes = None if per_block is None else blocks * per_block
        cost = (
            None
            if spec.prices is None or size_bytes is None
            else size_bytes / _GB * spec.prices.of(level)
        )
        levels.append(
            LevelPlan(
                name=level,
                blocks=blocks,
                tokens=blocks * spec.tokens_per_block,
                size_bytes=size_bytes,
                hit_blocks=hits - above,
                hit_rate=(hits - above) / curve.num_references,
                cost=cost,
            )
        )
        above = hits
    costs = [lv.cost for lv in levels]
    total = None if any(c is None for c in costs) else sum(c for c in costs if c is not None)
    return CombinationPlan(
        combination=name,
        levels=tuple(levels),
        hit_rate=above / curve.num_references,
        cost=total,
    )
