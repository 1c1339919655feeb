"""One instance of a cluster replay: a real `ReplayEngine` over its own memory system.

    EngineInstance(name, InstanceSpec, storage)
      build_memory_system(family, capacity_tokens, page_size, policy, enable_events=True)
      [build_tiers(system, host size, storage=<the shared L3>)]   with a host size or an L3
      ReplayEngine(system, tiers=...)                              the engine `kvstrata replay` runs

`serve(request)` is `engine.step(request)` (match on every tier, lock, allocate, write KV,
insert, unlock), then waits for the request's transfers (host writes, L3 backups) to land, and
returns the pages hit per tier; `take_events()` hands over the KV events
the tree (and its host tier) queued, for the router's prefix index. The L3 is whatever
`Storage` the caller passes: one in-process store shared by every instance, or a `ray://`
store the instance opens itself (a Ray actor). The same class runs in the driver's process and
inside the Ray actors of `kvstrata.replay_ray`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvstrata.build import build_memory_system
from kvstrata.build.tiers import TieredSystem, build_tiers
from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.pool import SWAKVPool
from kvstrata.replay.engine import ReplayEngine
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.request import ReplayRequest
from kvstrata.storage import Storage
from kvstrata.unified_radix_cache import KVEvent
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """The cache settings every instance of a cluster shares: page size, eviction policy, an
    optional host tier (`host_ratio` or `host_bytes`) and the hierarchical cache's write and
    prefetch parameters (used when there is a host tier or an L3). `ClusterSpec` and
    `InstanceSpec` both carry them."""

    page_size: int = 16
    policy: str = "lru"
    host_ratio: float | None = None
    host_bytes: int | None = None
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    prefetch_threshold: int = 256


@dataclass(frozen=True, kw_only=True)
class InstanceSpec(CacheSettings):
    """How every instance of a cluster is built: `capacity_tokens` device KV tokens and the
    shared `CacheSettings`. Picklable: it travels to Ray actors."""

    capacity_tokens: int
    #: Host writes submitted at once (1): an instance's pages reach the host, and through it
    #: the shared L3, with the request that wrote them, before another instance's next request.
    write_batch: int = 1

    def tier_params(self) -> TierParams:
        """The hierarchical cache's parameters; ReplayOptionError for bad ones."""
        try:
            return TierParams(
                write_policy=WritePolicy(self.write_policy),
                prefetch_policy=PrefetchPolicy(self.prefetch_policy),
                prefetch_threshold=self.prefetch_threshold,
                write_batch=self.write_batch,
            )
        except (InvalidConfig, ValueError) as exc:
            raise ReplayOptionError(str(exc)) from exc

    @property
    def has_host(self) -> bool:
        return self.host_ratio is not None or self.host_bytes is not None


class Served(NamedTuple):
    """What one request got on its instance: pages hit on the device, the host tier, the L3."""

    device_pages: int
    host_pages: int
    l3_pages: int

    @property
    def pages(self) -> int:
        return self.device_pages + self.host_pages + self.l3_pages


class EngineInstance:
    """A replay engine with its own device cache (and host tier), publishing KV events.

    `storage`: the L3 shared with the other instances (None: none). With an L3 and no host
    size, the host tier gets the default ratio (the hierarchical cache reaches storage through
    the host), as in `kvstrata replay --storage`. Raises ReplayOptionError / BuildError /
    HostPoolError before anything runs."""

    def __init__(self, name: str, spec: InstanceSpec, *, storage: Storage | None = None) -> None:
        params = spec.tier_params() if spec.has_host or storage is not None else None
        self.name = name
        self.spec = spec
        self.page_size = spec.page_size
        self.system = build_memory_system(
            family="mha",
            capacity_tokens=spec.capacity_tokens,
            page_size=spec.page_size,
            policy=spec.policy,
            enable_events=True,
        )
        self.tiers: TieredSystem | None = None
        if params is not None:
            self.tiers = build_tiers(
                self.system,
                host_ratio=spec.host_ratio,
                host_bytes=spec.host_bytes,
                storage=storage,
                params=params,
            )
        self.engine = ReplayEngine(self.system, tiers=self.tiers)

    @property
    def page_bytes(self) -> int:
        """Bytes of full-attention KV one page holds across the layers (what the L3 stores per
        page; an SWA model's window pages come on top)."""
        pool = self.system.kv_pool
        full = pool.full_pool if isinstance(pool, SWAKVPool) else pool
        return full.bytes_per_token * self.page_size

    def check_fits(self, requests: list[ReplayRequest]) -> None:
        """CapacityTooSmall when some prompt does not fit the device even when empty."""
        self.engine.check_fits(requests)

    def serve(self, request: ReplayRequest) -> Served:
        """Run `request` through the engine; the pages it hit, per tier. Mutates the caches."""
        counters = self.engine.counters
        before = (counters.device_hit_tokens, counters.host_hit_tokens, counters.storage_hit_tokens)
        self.engine.step(request)
        if self.tiers is not None:
            # The request's host writes and L3 backups land before the next request on any
            # instance: the L3 then holds the same pages whatever the transfers' timing (in
            # one process or across Ray actors).
            self.tiers.cache.drain()
        page = self.page_size
        return Served(
            device_pages=(counters.device_hit_tokens - before[0]) // page,
            host_pages=(counters.host_hit_tokens - before[1]) // page,
            l3_pages=(counters.storage_hit_tokens - before[2]) // page,
        )

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last call (device, and host tier when there is one)."""
        if self.tiers is not None:
            return self.tiers.cache.take_events()
        return self.system.tree.take_events()

    def check_integrity(self) -> None:
        if self.tiers is not None:
            self.tiers.check_integrity()
        else:
            self.system.check_integrity()

    def close(self) -> None:
        """Drain the transfers in flight and stop the tier workers (the L3 stays open)."""
        if self.tiers is not None:
            self.tiers.close()
