"""Per-layer routing across pools and the tier controller moving pages L1 <-> L2 <-> L3."""

from __future__ import annotations

from kvstrata.hybrid_cache.controller import ControllerParams, TierController
from kvstrata.hybrid_cache.errors import (
    ControllerClosed,
    HybridCacheError,
    InvalidOperation,
    InvalidPoolLayout,
    LayerKindMismatch,
    LayerLoadFailed,
    QueueFull,
    StorageNotConfigured,
    UnknownLayer,
    UnknownOperation,
)
from kvstrata.hybrid_cache.group import PoolGroup
from kvstrata.hybrid_cache.metrics import TierControllerCollector
from kvstrata.hybrid_cache.ops import (
    Ack,
    AckStatus,
    BackupOp,
    LoadOp,
    OpKind,
    PageMove,
    PagePairs,
    PrefetchOp,
    PrefetchPolicy,
    PrefetchProgress,
    PrefetchTimeout,
    WriteOp,
)
from kvstrata.hybrid_cache.restore import Restorable, RestoreKind, RestoreRule, restorable_pages
from kvstrata.hybrid_cache.router import HybridPool, LayerKind, LayerRouting, MambaLayerState
from kvstrata.hybrid_cache.transfers import LoadHandle

__all__: list[str] = [
    "Ack",
    "AckStatus",
    "BackupOp",
    "ControllerClosed",
    "ControllerParams",
    "HybridCacheError",
    "HybridPool",
    "InvalidOperation",
    "InvalidPoolLayout",
    "LayerKind",
    "LayerKindMismatch",
    "LayerLoadFailed",
    "LayerRouting",
    "LoadHandle",
    "LoadOp",
    "MambaLayerState",
    "OpKind",
    "PageMove",
    "PagePairs",
    "PoolGroup",
    "PrefetchOp",
    "PrefetchPolicy",
    "PrefetchProgress",
    "PrefetchTimeout",
    "QueueFull",
    "Restorable",
    "RestoreKind",
    "RestoreRule",
    "StorageNotConfigured",
    "TierController",
    "TierControllerCollector",
    "UnknownLayer",
    "UnknownOperation",
    "WriteOp",
    "restorable_pages",
]
