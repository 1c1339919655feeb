"""The reference engine, re-exported for tests: its home is `kvstrata.replay.reference_engine`
(where `kvstrata replay --engine reference` imports it; the replay sits below the testkit)."""

from __future__ import annotations

from kvstrata.replay.reference_engine import (
    EngineRun,
    ReferenceDims,
    ReferenceEngine,
    ReferenceModel,
    check_reference_model,
    reference_parameters,
)

__all__ = [
    "EngineRun",
    "ReferenceDims",
    "ReferenceEngine",
    "ReferenceModel",
    "check_reference_model",
    "reference_parameters",
]
