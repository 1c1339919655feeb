"""Types of the hierarchical mode: write policy, tier parameters, tiered match results, the
per-layer load-back handle, counters.

The hierarchical cache (hierarchy.py) keeps both tiers on the nodes of one `UnifiedRadixCache`
(device slots in `node.value`, host slots in `node.host_value`, see host_tier.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch

from kvstrata.hybrid_cache import LoadHandle, PrefetchPolicy, PrefetchTimeout
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import POLICIES
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
    write_batch: int = 16
    """Host writes queued before they are submitted together (the controller's worker wakes
    once per batch; a queued write already holds its host slots and both locks). The queue is
    also sent when its oldest write has waited this many `begin_request`s, before anything
    waits on a transfer, and with every load or prefetch submitted. 1: each write at once."""
    known_stored_states: int = 1 << 16
    """Mamba and SWA trees with storage: how many page keys of stored boundary states (Mamba)
    or SWA pages (SWA) the cache remembers (oldest forgotten first) to choose how far a
    prefetch fetches."""

    def __post_init__(self) -> None:
        if self.host_eviction_policy not in POLICIES:
            raise InvalidConfig(
                f"unknown host eviction policy {self.host_eviction_policy!r}; "
                f"choose from {sorted(POLICIES)}"
            )
        if self.prefetch_threshold < 1:
            raise InvalidConfig(f"prefetch_threshold must be >= 1, got {self.prefetch_threshold}")
        if self.write_batch < 1:
            raise InvalidConfig(f"write_batch must be >= 1, got {self.write_batch}")
        if self.known_stored_states < 1:
            raise InvalidConfig(f"known_stored_states must be >= 1, got {self.known_stored_states}")
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


class LoadBack(NamedTuple):
    """What `load_back` brought to the device: `loaded_len` tokens (0 when the host hit could
    not be loaded: no device room, a failed load), and the device match after it (valid while
    `match.last_node` is locked)."""

    loaded_len: int
    match: MatchResult


class TierLoad:
    """A load-back in flight (`HierarchicalCache.start_load_back`).

    `wait_layer(i)` returns once layer i's pages are on the device, so an engine's attention
    for layer i waits only for layer i; the tree commits the load (the nodes get their device
    slots back) only on the op's acknowledgement: at `wait()`, or at the cache's next `poll` /
    `drain` (a load started with `wait_now=True` on a controller that runs it inline: before
    `start_load_back` returns). Until then the loaded slots are not in the tree and a request
    must not be built on them. A load that was not started (nothing to load, no device room)
    is done at once with `loaded_len` 0. `num_tokens`: tokens being loaded.
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        handle: LoadHandle | None,
        finish: Callable[[TierLoad, float | None], LoadBack | None],
        result: LoadBack | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.handle = handle
        self._finish = finish
        self.result = result

    @property
    def op_id(self) -> int | None:
        """The controller's op id (None when no load was submitted)."""
        return None if self.handle is None else self.handle.op_id

    @property
    def done(self) -> bool:
        """Committed (or failed, or never started): `result` is set."""
        return self.result is not None

    def wait_layer(self, layer_id: int, timeout_s: float | None = None) -> bool:
        """Block until layer `layer_id` has arrived (True) or `timeout_s` passed (False).
        Commits nothing. LayerLoadFailed when the load failed before that layer arrived."""
        if self.handle is None:
            return True
        return self.handle.wait_layer(layer_id, timeout_s)

    def wait(self, timeout_s: float | None = None) -> LoadBack | None:
        """Wait for the acknowledgement and commit: the result (loaded_len 0 when the load
        failed: the slots were freed and the tree is unchanged), or None when `timeout_s`
        passed first (the load stays in flight; a later poll commits it)."""
        if self.result is not None:
            return self.result
        return self._finish(self, timeout_s)


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
    writes_submitted: int = 0
    """Host writes handed to the controller (queued ones go in batches: `write_batches`)."""
    write_batches: int = 0
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
    transfer_timeouts: int = 0
    """Waits that gave up on a transfer not acknowledged within `transfer_timeout_s` (the
    transfer stays in flight; its late ack still commits, or counts in failed_ops if failed)."""
    transfer_wait_seconds: float = 0.0
    """Time callers waited for transfers (load-backs, prefetches, write-back evictions)."""
