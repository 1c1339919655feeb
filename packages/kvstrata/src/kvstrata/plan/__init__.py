"""`kvstrata plan`: size the device, host and storage tiers from a trace of one's own traffic.

One pass over the trace gives the leaf-first LRU hit rate at every capacity (`lru_curve`, a
stack-distance histogram); the inclusive levels device <= host <= storage are read off that one
curve, and `plan_tiers` picks their sizes for a target hit rate (and prices, when given).
"""

from __future__ import annotations

from kvstrata.plan.curve import BlockTrace, HitCurve, lru_curve, read_block_trace
from kvstrata.plan.errors import PlanError, PlanOptionError, TargetUnreachable, TraceNotChained
from kvstrata.plan.sizing import (
    COMBINATIONS,
    CombinationPlan,
    LevelPlan,
    PlanSpec,
    TierPlan,
    TierPrices,
    plan_tiers,
)

__all__ = [
    "COMBINATIONS",
    "BlockTrace",
    "CombinationPlan",
    "HitCurve",
    "LevelPlan",
    "PlanError",
    "PlanOptionError",
    "PlanSpec",
    "TargetUnreachable",
    "TierPlan",
    "TierPrices",
    "TraceNotChained",
    "lru_curve",
    "plan_tiers",
    "read_block_trace",
]
