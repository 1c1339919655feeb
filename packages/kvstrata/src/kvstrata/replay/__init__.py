"""`kvstrata replay`, the main job: drive requests through the real allocator, pools and tree."""

from __future__ import annotations

from kvstrata.replay.engine import (
    ProgressCallback,
    ReplayEngine,
    StepResult,
    UnboundedCapacity,
    unbounded_capacity,
)
from kvstrata.replay.errors import (
    CapacityTooSmall,
    EmptyTrace,
    KVMismatch,
    ReferenceModelTooLarge,
    ReplayError,
    ReplayOptionError,
    RequestDoesNotFit,
    TraceFormatError,
    WorkloadSpecError,
)
from kvstrata.replay.metrics import ReplayCollector
from kvstrata.replay.request import ReplayRequest
from kvstrata.replay.stats import ReplayCounters, ReplayStats, TierStats
from kvstrata.replay.trace import iter_trace, read_trace
from kvstrata.replay.workload import WorkloadSpec, generate_workload

__all__ = [
    "CapacityTooSmall",
    "EmptyTrace",
    "KVMismatch",
    "ReferenceModelTooLarge",
    "ProgressCallback",
    "ReplayCollector",
    "ReplayCounters",
    "ReplayEngine",
    "ReplayError",
    "ReplayOptionError",
    "ReplayRequest",
    "ReplayStats",
    "RequestDoesNotFit",
    "StepResult",
    "TierStats",
    "TraceFormatError",
    "UnboundedCapacity",
    "WorkloadSpec",
    "WorkloadSpecError",
    "generate_workload",
    "iter_trace",
    "read_trace",
    "unbounded_capacity",
]
