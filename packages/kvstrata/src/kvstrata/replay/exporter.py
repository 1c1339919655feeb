"""Serving a replay's metrics: every layer's collector for one run, and an HTTP `/metrics`.

`replay_collectors` lists the collectors of one replay (the engine, the tree, the device pools
and allocators, and with tiers the hierarchical cache, the host mirrors, the tier controller and
the storage); `ConfigCollector` re-exports them with a constant `config` label, so the several
configurations of one `kvstrata replay` run share one registry without clashing series; and
`MetricsServer` serves a registry on `http://ADDR:PORT/metrics` (loopback by default) until
closed. Nothing is registered at import.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvstrata.allocator.metrics import AllocatorCollector
from kvstrata.hybrid_cache.metrics import TierControllerCollector
from kvstrata.pool.metrics import PoolCollector
from kvstrata.pool_host.metrics import HostPoolCollector
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.metrics import ReplayCollector
from kvstrata.storage.metrics import StorageCollector
from kvstrata.unified_radix_cache.metrics import RadixCacheCollector
from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from kvstrata.allocator.base import SlotAllocator
    from kvstrata.build import MemorySystem
    from kvstrata.build.tiers import TieredSystem
    from kvstrata.replay.engine import ReplayEngine

__all__ = ["ConfigCollector", "MetricsServer", "replay_collectors"]


def replay_collectors(
    engine: ReplayEngine, system: MemorySystem, tiers: TieredSystem | None
) -> list[Collector]:
    """The collectors of every layer one replay drives. Names given to the objects: pools
    `kv` (an SWA pool appears as `kv.full` and `kv.swa`) and `state`; allocators `kv` and
    `state`; host mirrors by pool group member (`full`, `swa`, `mamba`); controller and
    storage `l3` / `replay`."""
    pools: dict[str, object] = {"kv": system.kv_pool}
    allocators: dict[str, SlotAllocator] = {"kv": system.kv_allocator}
    if system.mamba_pool is not None and system.mamba_allocator is not None:
        pools["state"] = system.mamba_pool
        allocators["state"] = system.mamba_allocator
    collectors: list[Collector] = []
    collectors += [
        ReplayCollector(engine),
        RadixCacheCollector(system.tree),
        PoolCollector(pools),  # pyright: ignore[reportArgumentType]
        AllocatorCollector(allocators),
    ]
    if tiers is not None:
        cache = tiers.cache
        host_allocators = {"full": cache.host_allocator}
        if cache.host_swa_allocator is not None and "swa" in tiers.host_pools:
            host_allocators["swa"] = cache.host_swa_allocator
        collectors += [
            TierCacheCollector(cache),
            HostPoolCollector(dict(tiers.host_pools), allocators=host_allocators),
            TierControllerCollector({"replay": tiers.controller}),
        ]
        if tiers.storage is not None:
            collectors.append(StorageCollector({"l3": tiers.storage}))
    return collectors


class ConfigCollector(Collector):
    """Yields the families of `collectors` with constant labels added to every sample (e.g.
    `{"config": "device+host"}`). Defines no `describe`, so registering it scrapes nothing."""

    def __init__(self, collectors: Sequence[Collector], labels: Mapping[str, str]) -> None:
        self._collectors = list(collectors)
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            for family in collector.collect():
                labelled = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labelled.add_sample(
                        sample.name,
                        {**sample.labels, **self._labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield labelled


class MetricsServer:
    """`/metrics` of `registry` on `addr:port` from a daemon thread, until `close()`.

    Port 0 takes a free port (`port` then tells which). Raises ReplayOptionError for a port out
    of range or an address that is not an IP address, and OSError when the port is taken."""

    def __init__(self, registry: CollectorRegistry, *, port: int, addr: str = "127.0.0.1") -> None:
        if not 0 <= port <= 65535:
            raise ReplayOptionError(f"--metrics-port must be in 0..65535, got {port}")
        try:
            ipaddress.ip_address(addr)
        except ValueError as exc:
            raise ReplayOptionError(f"--metrics-addr must be an IP address, got {addr!r}") from exc
        server, thread = start_http_server(port, addr=addr, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.addr = addr
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
