"""Cluster replay: N engine instances behind a `Router`, sharing one L3 store.

Each instance is a real replay engine (`cluster_instance.EngineInstance`: the `ReplayEngine` of
`kvstrata replay` over its own memory system, with a host tier when asked) whose tree publishes
KV events; the events feed the router's prefix index. Where the instances run is a
`ClusterBackend`: `LocalCluster` (here: every instance in this process, one `PrefixIndex`, the
L3 one in-process `Storage` shared by all) or `kvstrata.replay_ray.RayCluster` (Ray actors, the
prefix index shard actors, `ray://` L3 stores). Requests arrive in trace-timestamp order (file
order for equal or missing timestamps). Per request:

    finish    every routed request whose estimated end is at or before this arrival
    route     router.route(page keys): picks the instance and charges its load (prompt pages)
    serve     backend.serve(k, request): the engine's step on instance k (match on every tier,
              lock, allocate, write KV, insert, unlock), then the instance's events go to the
              index; returns the pages hit on the device, the host tier and the L3

The engine matches at most N - 1 tokens of an N-token prompt (it computes at least one), so a
prompt seen whole before hits all its pages but the last. The L3 is reached through the host
tier (the hierarchical cache writes device pages through to the host and the host's to the L3,
and prefetches from the L3 what lies beyond the host hit): with an L3 and no host size, each
instance gets a host tier of the default ratio, as `kvstrata replay --storage` does.

A request's load lasts its duration estimate, `(prompt tokens not hit) / prefill_tps +
output_length / decode_tps` seconds after its arrival (defaults 10,000 prefill tokens/s and 50
decode tokens/s per instance, i.e. batch-of-one decoding; both are parameters).

The pooled ideal is one device-only engine of the summed device capacity serving every request
in this process.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.prefix_index import PrefixIndex, RouteDecision, Router
from kvstrata.prefix_index.router import MatchSource
from kvstrata.replay.cluster_instance import (
    CacheSettings,
    EngineInstance,
    InstanceSpec,
    Served,
)
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.request import ReplayRequest
from kvstrata.storage import PageKeyer, Storage

#: CLI spelling of the router policies.
ROUTERS = {
    "round-robin": "round_robin",
    "least-loaded": "least_loaded",
    "cache-aware": "cache_aware",
}


@dataclass(kw_only=True)
class InstanceReport:
    """What one instance served: requests, prompt pages routed to it, hits per tier."""

    name: str
    requests: int = 0
    pages: int = 0
    device_hits: int = 0
    host_hits: int = 0
    l3_hits: int = 0

    @property
    def hits(self) -> int:
        return self.device_hits + self.host_hits + self.l3_hits


@dataclass(kw_only=True)
class ClusterReport:
    """A cluster replay's outcome. `timeline` has one row per request in arrival order:
    (arrival s, instance index, prompt pages, hit pages, in-flight pages of every instance)."""

    router: str
    num_instances: int
    capacity_pages: int
    l3_capacity_pages: int
    instances: list[InstanceReport]
    pooled_hits: int
    backend: str = "in-process"
    timeline: list[tuple[float, int, int, int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(i.requests for i in self.instances)

    @property
    def pages(self) -> int:
        return sum(i.pages for i in self.instances)

    @property
    def hits(self) -> int:
        return sum(i.hits for i in self.instances)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.pages if self.pages else 0.0

    @property
    def pooled_hit_rate(self) -> float:
        return self.pooled_hits / self.pages if self.pages else 0.0

    @property
    def max_load_ratio(self) -> float:
        """Busiest instance's routed prompt pages over the mean (1.0 = perfectly even)."""
        loads = [i.pages for i in self.instances]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 0.0

    def to_json(self) -> dict[str, object]:
        pages = self.pages
        return {
            "router": self.router,
            "backend": self.backend,
            "instances": self.num_instances,
            "capacity_pages_per_instance": self.capacity_pages,
            "l3_capacity_pages": self.l3_capacity_pages,
            "requests": self.requests,
            "pages": pages,
            "hit_pages": self.hits,
            "hit_rate": self.hit_rate,
            "device_hit_pages": sum(i.device_hits for i in self.instances),
            "host_hit_pages": sum(i.host_hits for i in self.instances),
            "l3_hit_pages": sum(i.l3_hits for i in self.instances),
            "max_load_ratio": self.max_load_ratio,
            "pooled_hit_pages": self.pooled_hits,
            "pooled_hit_rate": self.pooled_hit_rate,
            "per_instance": [
                {
                    "name": i.name,
                    "requests": i.requests,
                    "pages": i.pages,
                    "load_share": i.pages / pages if pages else 0.0,
                    "device_hit_pages": i.device_hits,
                    "host_hit_pages": i.host_hits,
                    "l3_hit_pages": i.l3_hits,
                    "hit_rate": i.hits / i.pages if i.pages else 0.0,
                }
                for i in self.instances
            ],
        }


@dataclass(frozen=True, kw_only=True)
class ClusterSpec(CacheSettings):
    """Shape of the cluster. Checked on construction (ReplayOptionError). The instances are
    built by `instance_spec()`: `capacity_pages` x `page_size` device tokens each and the
    cluster's `CacheSettings` (the eviction `policy`, a host tier of `host_ratio` /
    `host_bytes` when given, and the hierarchical cache's write and prefetch parameters)."""

    num_instances: int
    capacity_pages: int
    router: str
    prefill_tps: float = 10_000.0
    decode_tps: float = 50.0
    load_weight: float = 1.0
    prefill_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ReplayOptionError(f"--instances must be >= 1, got {self.num_instances}")
        if self.capacity_pages < 1:
            raise ReplayOptionError(
                f"each instance needs at least one page of capacity, got {self.capacity_pages}"
            )
        if self.router not in ROUTERS:
            raise ReplayOptionError(
                f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}"
            )
        if self.page_size < 1:
            raise ReplayOptionError(f"--page-size must be >= 1, got {self.page_size}")
        if self.prefill_tps <= 0 or self.decode_tps <= 0:
            raise ReplayOptionError(
                f"token rates must be > 0, got prefill {self.prefill_tps}, decode {self.decode_tps}"
            )
        if self.load_weight < 0 or self.prefill_weight < 0:
            raise ReplayOptionError(
                f"router weights must be >= 0, got load {self.load_weight}, "
                f"prefill {self.prefill_weight}"
            )
        if self.host_ratio is not None and self.host_bytes is not None:
            raise ReplayOptionError("give at most one of --host-ratio, --host-bytes")
        if any(x is not None and x <= 0 for x in (self.host_ratio, self.host_bytes)):
            raise ReplayOptionError("the host tier size must be > 0")
        self.instance_spec().tier_params()  # write / prefetch parameters checked here

    @property
    def names(self) -> list[str]:
        return [f"instance-{i}" for i in range(self.num_instances)]

    def instance_spec(self, *, capacity_pages: int | None = None) -> InstanceSpec:
        """How each instance is built (`capacity_pages`: another device size, the pooled one)."""
        return InstanceSpec(
            capacity_tokens=(capacity_pages or self.capacity_pages) * self.page_size,
            page_size=self.page_size,
            policy=self.policy,
            host_ratio=self.host_ratio,
            host_bytes=self.host_bytes,
            write_policy=self.write_policy,
            prefetch_policy=self.prefetch_policy,
            prefetch_threshold=self.prefetch_threshold,
        )


class ClusterBackend(Protocol):
    """Where the instances run. `index` answers the router's matches; `serve(k, request)` runs
    the request on instance k and hands the instance's KV events to the index before it
    returns (so the next route sees them); `l3_capacity_pages` is the shared L3's size in pages
    (0: none); `close()` stops the instances (idempotent)."""

    @property
    def index(self) -> MatchSource: ...

    @property
    def l3_capacity_pages(self) -> int: ...

    def serve(self, k: int, request: ReplayRequest) -> Served: ...

    def close(self) -> None: ...


class LocalCluster:
    """Every instance an `EngineInstance` in this process; one `PrefixIndex`; `l3` (if any)
    the store they all share. Builds the instances on construction (ReplayOptionError /
    BuildError / HostPoolError before any request runs)."""

    def __init__(self, spec: ClusterSpec, *, l3: Storage | None = None) -> None:
        self.names = spec.names
        self._index = PrefixIndex(spec.page_size)
        self._l3 = l3
        self.instances: list[EngineInstance] = []
        try:
            for name in self.names:
                self.instances.append(EngineInstance(name, spec.instance_spec(), storage=l3))
        except BaseException:
            self.close()
            raise

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @property
    def l3_capacity_pages(self) -> int:
        if self._l3 is None:
            return 0
        return self._l3.stats().capacity_bytes // self.instances[0].page_bytes

    def serve(self, k: int, request: ReplayRequest) -> Served:
        instance = self.instances[k]
        served = instance.serve(request)
        self._index.apply(instance.name, instance.take_events())
        return served

    def check_integrity(self) -> None:
        for instance in self.instances:
            instance.check_integrity()
        self._index.check_integrity()

    def close(self) -> None:
        """Close every instance, even when one raises (the first error is re-raised)."""
        first: BaseException | None = None
        for instance in self.instances:
            try:
                instance.close()
            except BaseException as exc:  # noqa: BLE001 (the others must still stop)
                first = first or exc
        if first is not None:
            raise first


def arrival_order(requests: Sequence[ReplayRequest]) -> list[int]:
    """Indices of `requests` by timestamp (missing: 0), ties in file order."""
    return sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_ms or 0, i))


def check_prompts(spec: ClusterSpec, requests: Sequence[ReplayRequest]) -> None:
    """ReplayOptionError when a prompt does not fit one instance's device (nothing changed)."""
    ps = spec.page_size
    longest = max((-(-r.num_tokens // ps) for r in requests), default=0)
    if longest > spec.capacity_pages:
        raise ReplayOptionError(
            f"a prompt of {longest} pages does not fit an instance of {spec.capacity_pages} "
            "pages; raise --capacity-tokens"
        )


def run_cluster(
    spec: ClusterSpec,
    requests: Sequence[ReplayRequest],
    *,
    l3: Storage | None = None,
    backend: ClusterBackend | None = None,
) -> ClusterReport:
    """Replay `requests` through the cluster of `spec`. Without `backend`, a `LocalCluster`
    sharing `l3` (if any; mutated: it is the shared store) is built and closed here; a given
    `backend` is used as it is and left open (its owner closes it; `l3` must then be None).
    Raises ReplayOptionError before any state changes when a prompt is longer than one
    instance's capacity."""
    if backend is not None and l3 is not None:
        raise ReplayOptionError("a given backend brings its own L3: pass no l3")
    check_prompts(spec, requests)
    own = backend is None
    cluster: ClusterBackend = LocalCluster(spec, l3=l3) if backend is None else backend
    try:
        return _drive(spec, requests, cluster)
    finally:
        if own:
            cluster.close()


def _drive(
    spec: ClusterSpec, requests: Sequence[ReplayRequest], cluster: ClusterBackend
) -> ClusterReport:
    ps = spec.page_size
    names = spec.names
    keyer = PageKeyer(page_size=ps)
    reports = [InstanceReport(name=n) for n in names]
    router = Router(
        cluster.index,
        names,
        policy=ROUTERS[spec.router],
        load_weight=spec.load_weight,
        prefill_weight=spec.prefill_weight,
    )
    pooled = EngineInstance(
        "pooled", spec.instance_spec(capacity_pages=spec.capacity_pages * spec.num_instances)
    )
    pooled_hits = 0
    running: list[tuple[float, int, RouteDecision]] = []  # (end s, seq, decision)
    timeline: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    try:
        for seq, i in enumerate(arrival_order(requests)):
            request = requests[i]
            now = (request.timestamp_ms or 0) / 1000.0
            while running and running[0][0] <= now:
                router.finish(heapq.heappop(running)[2])
            keys = keyer.page_keys(request.token_ids)
            decision = router.route(keys)
            k = names.index(decision.instance)
            served = cluster.serve(k, request)
            pooled_hits += pooled.serve(request).pages
            pooled.take_events()
            report = reports[k]
            report.requests += 1
            report.pages += len(keys)
            report.device_hits += served.device_pages
            report.host_hits += served.host_pages
            report.l3_hits += served.l3_pages
            duration = (request.num_tokens - served.pages * ps) / spec.prefill_tps + (
                request.output_length / spec.decode_tps
            )
            heapq.heappush(running, (now + duration, seq, decision))
            loads = tuple(router.load[n] for n in names)
            timeline.append((now, k, len(keys), served.pages, loads))
    finally:
        pooled.close()
    return ClusterReport(
        router=spec.router,
        num_instances=spec.num_instances,
        capacity_pages=spec.capacity_pages,
        l3_capacity_pages=cluster.l3_capacity_pages,
        instances=reports,
        pooled_hits=pooled_hits,
        backend=type(cluster).__name__,
        timeline=timeline,
    )
