"""One radix tree deciding what every model family keeps, with pluggable state components."""

from __future__ import annotations

from kvstrata.unified_radix_cache.components.base import ComponentInsert, SlotSink, TreeComponent
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.mamba import MambaComponent, MambaInsert
from kvstrata.unified_radix_cache.components.swa import SWAComponent, SWAInsert
from kvstrata.unified_radix_cache.device_cache import DeviceCache, SlotSource
from kvstrata.unified_radix_cache.events import (
    EVENT_FORMAT_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_events,
    encode_events,
)
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache, HostSlots
from kvstrata.unified_radix_cache.host_tier import HostEviction, HostReceipt, HostTier
from kvstrata.unified_radix_cache.key import Namespace, RadixKey
from kvstrata.unified_radix_cache.metrics import RadixCacheCollector
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import POLICIES
from kvstrata.unified_radix_cache.protocol import LayerWait, PrefixCache, PrefixHit
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import (
    EvictRequest,
    EvictResult,
    InsertResult,
    LockReceipt,
    MatchResult,
)
from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector
from kvstrata.unified_radix_cache.tiers import (
    LoadBack,
    TierCounters,
    TieredMatch,
    TierLoad,
    TierParams,
    WritePolicy,
)
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

__all__ = [
    "PrefixCache",
    "PrefixHit",
    "LayerWait",
    "DeviceCache",
    "SlotSource",
    "WritePolicy",
    "TieredMatch",
    "TierParams",
    "TierCounters",
    "TierCacheCollector",
    "LoadBack",
    "HostSlots",
    "HostTier",
    "HostReceipt",
    "HostEviction",
    "TierLoad",
    "HierarchicalCache",
    "EVENT_FORMAT_VERSION",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "ComponentInsert",
    "EvictRequest",
    "EvictResult",
    "FullComponent",
    "InsertResult",
    "KVEvent",
    "LockReceipt",
    "MambaComponent",
    "MambaInsert",
    "MatchResult",
    "Namespace",
    "POLICIES",
    "RadixCacheCollector",
    "RadixKey",
    "SWAComponent",
    "SWAInsert",
    "SlotSink",
    "TreeComponent",
    "TreeNode",
    "UnifiedRadixCache",
    "decode_events",
    "encode_events",
]
