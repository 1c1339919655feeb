"""Types of the hierarchical mode: write policy, tier parameters, tiered match results, counters.

The hierarchical cache (hierarchy.py) keeps the device tier in a `UnifiedRadixCache` over the
device allocator and the host tier in a second one over the host slot allocator, so that each
tier keeps its own locks, eviction policy and `free + evictable + protected == capacity` sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch

from kvstrata.hybrid_cache import PrefetchPolicy, PrefetchTimeout
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import POLICIES
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import MatchResult

HOST_TIER = "host"
STORAGE_TIER = "storage"


class WritePolicy(StrEnum):
    """When device pages are backed up to the host (TIERS.md, BEHAVIOURS.md 21)."""

    WRITE_THROUGH = "write_through"
    """On insert: every new device page is written to the host at once (first hit)."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """When a device prefix is matched the second time (saves bandwidth on one-off prompts)."""
    WRITE_BACK = "write_back"
    """Only when the device evicts the pages; the eviction waits for the copy."""


@dataclass(frozen=True, kw_only=True)
class TierParams:
    """Tuning of a `HierarchicalCache`."""

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    host_eviction_policy: str = "lru"
    """Order in which host copies go (lru, lfu, fifo, mru, filo, priority)."""
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_threshold: int = 256
    """Tokens beyond the host hit below which no prefetch starts (too short to pay off)."""
    prefetch_timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)
    backup_to_storage: bool = True
    """Back host pages up to storage after each host write (needs a controller with storage)."""
    transfer_timeout_s: float = 60.0
    """Longest wait for one synchronous transfer (load-back, write-back eviction)."""

    def __post_init__(self) -> None:
        if self.host_eviction_policy not in POLICIES:
            raise InvalidConfig(
                f"unknown host eviction policy {self.host_eviction_policy!r}; "
                f"choose from {sorted(POLICIES)}"
            )
        if self.prefetch_threshold < 1:
            raise InvalidConfig(f"prefetch_threshold must be >= 1, got {self.prefetch_threshold}")
        if not self.transfer_timeout_s > 0:
            raise InvalidConfig(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")


class TieredMatch(NamedTuple):
    """A match over both tiers.

    `device` is the device tree's match (its `device_indices` are valid while its `last_node`
    is locked). `host_hit_len` tokens beyond `device.prefix_len` are on the host, in host slots
    `host_indices` (valid while `host_node` is locked on the host tree; `load_back` takes that
    lock itself). `host_node` is the host tree's node ending at `device.prefix_len +
    host_hit_len`: the node to hand to `load_back`. `prefetch_id` is the controller's op id of a
    prefetch this match started from storage (None: none started).
    """

    device: MatchResult
    host_hit_len: int
    host_indices: torch.Tensor
    host_node: TreeNode
    prefetch_id: int | None = None

    @property
    def prefix_len(self) -> int:
        """Tokens usable after a load-back: the device hit plus the host hit."""
        return self.device.prefix_len + self.host_hit_len


class TieredRequest(NamedTuple):
    """`HierarchicalCache.begin_request`: the running request (its lock and its
    `kv_indices[:cached_len]` on the device) and how many of its cached tokens were already on
    the device, came back from the host, and came from storage through the host."""

    request: CacheRequest
    device_hit_len: int
    host_hit_len: int
    storage_hit_len: int


class LoadBack(NamedTuple):
    """What `load_back` brought to the device: `loaded_len` tokens (0 when the host hit could
    not be loaded: no device room, a failed load), and the device match after it (valid while
    `match.last_node` is locked)."""

    loaded_len: int
    match: MatchResult


@dataclass(kw_only=True)
class TierCounters:
    """Plain counters of a `HierarchicalCache` (read by `TierCacheCollector`). Tokens unless a
    name says otherwise."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    """Tokens prefetched from storage into the host tier (acknowledged and committed)."""
    queried_tokens: int = 0
    loaded_tokens: int = 0
    """Host -> device tokens committed by load-backs."""
    written_tokens: int = 0
    """Device -> host tokens committed by write acks."""
    backed_up_tokens: int = 0
    """Host -> storage tokens the storage acknowledged."""
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    bytes_storage_get: int = 0
    bytes_storage_set: int = 0
    host_evicted_tokens: int = 0
    failed_ops: int = 0
    """Acks with status failed (any kind): the tree kept its previous state."""
    short_prefetches: int = 0
    """Prefetches that delivered fewer pages than asked (miss, fault, policy stop)."""
    prefetches_started: int = 0
    prefetches_skipped: int = 0
    """Prefetches not started: host share or host room exhausted."""
    load_backs_refused: int = 0
    """Load-backs that found no device room: the request proceeded with the device hit."""
    transfer_wait_seconds: float = 0.0
    """Time callers waited for transfers (load-backs, prefetches, write-back evictions)."""
