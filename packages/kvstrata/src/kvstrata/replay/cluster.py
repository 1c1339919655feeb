"""Cluster replay: N engine instances behind a `Router`, sharing one L3 store, in one process.

Each instance is a `prefix_index.SimInstance` (a device-only LRU `UnifiedRadixCache` of a fixed
number of pages, the instance model of the routing simulation); the instances' `take_events()`
feed the router's `PrefixIndex`. Requests arrive in trace-timestamp order (file order for equal
or missing timestamps). Per request:

    finish    every routed request whose estimated end is at or before this arrival
    route     router.route(page keys): picks the instance and charges its load (prompt pages)
    device    instance.serve(tokens): pages matched on the device (LRU touch, evict, insert)
    l3        with a shared L3: the pages after the device hit that the L3 holds, from the
              first (batch_exists, then batch_get to mark them used); then every page of the
              prompt is written through to the L3 (batch_set; pages already there are skipped)
    index     index.apply(instance, take_events())

A request's load lasts its duration estimate, `(prompt tokens not hit) / prefill_tps +
output_length / decode_tps` seconds after its arrival (defaults 10,000 prefill tokens/s and 50
decode tokens/s per instance, i.e. batch-of-one decoding; both are parameters). The L3 holds
each page as `page_size` bytes, so a `memory://?capacity_bytes=N` store holds N tokens.

The pooled ideal is one device-only instance of the summed device capacity serving every request.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.prefix_index import PrefixIndex, RouteDecision, Router
from kvstrata.prefix_index.simulate import SimInstance
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.request import ReplayRequest
from kvstrata.storage import Storage

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
    l3_hits: int = 0

    @property
    def hits(self) -> int:
        return self.device_hits + self.l3_hits


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
            "instances": self.num_instances,
            "capacity_pages_per_instance": self.capacity_pages,
            "l3_capacity_pages": self.l3_capacity_pages,
            "requests": self.requests,
            "pages": pages,
            "hit_pages": self.hits,
            "hit_rate": self.hit_rate,
            "device_hit_pages": sum(i.device_hits for i in self.instances),
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
                    "l3_hit_pages": i.l3_hits,
                    "hit_rate": i.hits / i.pages if i.pages else 0.0,
                }
                for i in self.instances
            ],
        }


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Shape of the cluster. Checked on construction (ReplayOptionError)."""

    num_instances: int
    capacity_pages: int
    router: str
    page_size: int = 1
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


def arrival_order(requests: Sequence[ReplayRequest]) -> list[int]:
    """Indices of `requests` by timestamp (missing: 0), ties in file order."""
    return sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_ms or 0, i))


def run_cluster(
    spec: ClusterSpec, requests: Sequence[ReplayRequest], *, l3: Storage | None = None
) -> ClusterReport:
    """Replay `requests` through the cluster of `spec`, sharing `l3` (if any) between instances.
    Mutates `l3` (it is the shared store). Raises ReplayOptionError before any state changes
    when a prompt is longer than one instance's capacity."""
    ps = spec.page_size
    longest = max((r.num_tokens // ps for r in requests), default=0)
    if longest > spec.capacity_pages:
        raise ReplayOptionError(
            f"a prompt of {longest} pages does not fit an instance of {spec.capacity_pages} "
            "pages; raise --capacity-tokens"
        )
    names = [f"instance-{i}" for i in range(spec.num_instances)]
    sims = [SimInstance(n, capacity_pages=spec.capacity_pages, page_size=ps) for n in names]
    reports = [InstanceReport(name=n) for n in names]
    index = PrefixIndex(ps)
    router = Router(
        index,
        names,
        policy=ROUTERS[spec.router],
        load_weight=spec.load_weight,
        prefill_weight=spec.prefill_weight,
    )
    pooled = SimInstance(
        "pooled", capacity_pages=spec.capacity_pages * spec.num_instances, page_size=ps
    )
    pooled_hits = 0
    l3_pages = 0
    if l3 is not None:
        l3_pages = l3.stats().capacity_bytes // ps
    page = bytes(ps)
    running: list[tuple[float, int, RouteDecision]] = []  # (end s, seq, decision)
    timeline: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    for seq, i in enumerate(arrival_order(requests)):
        request = requests[i]
        now = (request.timestamp_ms or 0) / 1000.0
        while running and running[0][0] <= now:
            router.finish(heapq.heappop(running)[2])
        keys = index.page_keys(request.token_ids)
        tokens = array("q")
        tokens.frombytes(request.token_ids.tobytes())
        decision = router.route(keys)
        k = names.index(decision.instance)
        sim, report = sims[k], reports[k]
        device = sim.serve(tokens)
        from_l3 = 0
        if l3 is not None and keys:
            rest = keys[device:]
            from_l3 = l3.batch_exists(rest) if rest else 0
            if from_l3:
                l3.batch_get(rest[:from_l3], [bytearray(ps) for _ in range(from_l3)])
            l3.batch_set(list(keys), [page] * len(keys))
        index.apply(decision.instance, sim.take_events())
        pooled_hits += pooled.serve(tokens)
        pooled.take_events()
        report.requests += 1
        report.pages += len(keys)
        report.device_hits += device
        report.l3_hits += from_l3
        hit_tokens = (device + from_l3) * ps
        duration = (request.num_tokens - hit_tokens) / spec.prefill_tps + (
            request.output_length / spec.decode_tps
        )
        heapq.heappush(running, (now + duration, seq, decision))
        loads = tuple(router.load[n] for n in names)
        timeline.append((now, k, len(keys), device + from_l3, loads))
    return ClusterReport(
        router=spec.router,
        num_instances=spec.num_instances,
        capacity_pages=spec.capacity_pages,
        l3_capacity_pages=l3_pages,
        instances=reports,
        pooled_hits=pooled_hits,
        timeline=timeline,
    )
