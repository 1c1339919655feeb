"""Cluster-wide prefix index: page key -> which engine instance holds it, on which tier; fed by
kvstrata, vLLM and SGLang KV events; a router on top; sharded as Ray actors (`cluster`)."""

from __future__ import annotations

from kvstrata.prefix_index.dump import dump_tree
from kvstrata.prefix_index.errors import (
    EngineDecodeError,
    InvalidEvent,
    InvalidInstance,
    InvalidParameter,
    NoInstances,
    PrefixIndexError,
    ReentrantCall,
    ShardCallFailed,
    ShardUnavailable,
    UnknownFormat,
    UnknownPolicy,
)
from kvstrata.prefix_index.index import (
    IndexStats,
    InstanceMatch,
    PrefixIndex,
    PrefixMatches,
)
from kvstrata.prefix_index.router import POLICIES, RouteDecision, Router
from kvstrata.prefix_index.simulate import SimInstance, SimResult, read_trace, simulate
from kvstrata.prefix_index.tiers import DEFAULT_TIER_WEIGHTS, DEVICE, HOST, STORAGE

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "DEVICE",
    "HOST",
    "POLICIES",
    "STORAGE",
    "EngineDecodeError",
    "IndexStats",
    "InstanceMatch",
    "InvalidEvent",
    "InvalidInstance",
    "InvalidParameter",
    "NoInstances",
    "PrefixIndex",
    "PrefixIndexError",
    "PrefixMatches",
    "ReentrantCall",
    "RouteDecision",
    "Router",
    "ShardCallFailed",
    "ShardUnavailable",
    "SimInstance",
    "SimResult",
    "UnknownFormat",
    "UnknownPolicy",
    "dump_tree",
    "read_trace",
    "simulate",
]
