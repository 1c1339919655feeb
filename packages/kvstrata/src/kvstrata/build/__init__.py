"""Construction: a model config and a capacity in, a wired memory system out."""

from __future__ import annotations

from kvstrata.build.assembly import (
    BuildOptions,
    BuiltSystem,
    build,
    build_tiered,
    build_with_plan,
)
from kvstrata.build.errors import (
    BudgetTooSmall,
    BuildError,
    DeviceUnavailable,
    HostMemoryExceeded,
    InvalidCapacity,
    InvalidModel,
    MissingConfigField,
    TiersUnsupported,
    UnknownArchitecture,
    UnknownFamily,
    UnknownPolicy,
)
from kvstrata.build.factory import FAMILIES, POLICIES, build_memory_system
from kvstrata.build.mamba import MambaModel
from kvstrata.build.metrics import collectors
from kvstrata.build.mha import MHAModel
from kvstrata.build.model_spec import ModelMemorySpec
from kvstrata.build.sizing import HostPlan, MemoryPlan, SizingParams, plan_memory
from kvstrata.build.swa import SWAModel
from kvstrata.build.system import BuildParams, MemorySystem
from kvstrata.build.tiers import TieredSystem, build_host_pools, build_tiers

__all__ = [
    "FAMILIES",
    "POLICIES",
    "BudgetTooSmall",
    "BuildOptions",
    "BuildError",
    "BuildParams",
    "BuiltSystem",
    "DeviceUnavailable",
    "HostMemoryExceeded",
    "HostPlan",
    "InvalidCapacity",
    "InvalidModel",
    "MHAModel",
    "MambaModel",
    "MemoryPlan",
    "MemorySystem",
    "MissingConfigField",
    "ModelMemorySpec",
    "SWAModel",
    "SizingParams",
    "TieredSystem",
    "TiersUnsupported",
    "UnknownArchitecture",
    "UnknownFamily",
    "UnknownPolicy",
    "build",
    "build_memory_system",
    "build_tiered",
    "build_host_pools",
    "build_tiers",
    "build_with_plan",
    "collectors",
    "plan_memory",
]
