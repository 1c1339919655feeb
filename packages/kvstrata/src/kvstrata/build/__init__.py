"""Construction: a model config and a capacity in, a wired memory system out."""

from __future__ import annotations

from kvstrata.build.errors import (
    BuildError,
    DeviceUnavailable,
    InvalidCapacity,
    InvalidModel,
    TiersUnsupported,
    UnknownFamily,
    UnknownPolicy,
)
from kvstrata.build.factory import FAMILIES, POLICIES, build_memory_system
from kvstrata.build.mamba import MambaModel
from kvstrata.build.mha import MHAModel
from kvstrata.build.swa import SWAModel
from kvstrata.build.system import BuildParams, MemorySystem
from kvstrata.build.tiers import TieredSystem, build_tiers

__all__ = [
    "FAMILIES",
    "POLICIES",
    "BuildError",
    "BuildParams",
    "DeviceUnavailable",
    "InvalidCapacity",
    "InvalidModel",
    "MHAModel",
    "MambaModel",
    "MemorySystem",
    "SWAModel",
    "TieredSystem",
    "TiersUnsupported",
    "UnknownFamily",
    "UnknownPolicy",
    "build_memory_system",
    "build_tiers",
]
