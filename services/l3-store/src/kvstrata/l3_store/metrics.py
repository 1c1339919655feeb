"""Prometheus metrics of one store, read from `StoreCore.stats()` at scrape time (nothing on the
hot path). The store actor serves them on its own registry (`StoreActor` binds 127.0.0.1 by
default: a scraper on the node, or a Ray/Prometheus sidecar, reaches it; pass another address
to expose it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstrata.l3_store.core import CoreStats

_GAUGES = (
    ("memory_pages", "pages in the shared-memory arena"),
    ("memory_used_bytes", "arena bytes held by pages and reservations"),
    ("memory_capacity_bytes", "arena byte budget"),
    ("disk_pages", "pages spilled to the local disk"),
    ("disk_used_bytes", "disk bytes held by pages (headers included)"),
    ("disk_capacity_bytes", "disk byte budget"),
    ("active_leases", "leases pinning pages under readers"),
    ("active_reservations", "writes reserved and not yet committed"),
)
_COUNTERS = (
    ("hits_memory", "pages read from memory"),
    ("hits_disk", "pages read back from disk"),
    ("misses", "pages asked for and not stored"),
    ("pages_written", "pages stored"),
    ("bytes_written", "page bytes stored"),
    ("pages_read", "pages handed to readers"),
    ("bytes_read", "page bytes handed to readers"),
    ("write_failures", "pages refused (no room, checksum mismatch)"),
    ("checksum_failures", "pages whose bytes did not match the writer's checksum"),
    ("spills", "pages moved from memory to disk"),
    ("drops", "pages evicted without a disk copy"),
    ("expired", "leases and reservations dropped at their deadline"),
    ("operations", "store calls"),
)


class StoreCollector(Collector):
    """`kvstrata_l3_store_*` gauges and counters of one store, labelled by node."""

    def __init__(self, stats: Callable[[], CoreStats], *, node_id: str) -> None:
        self._stats = stats
        self._node_id = node_id

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for name, doc in _GAUGES:
            family = GaugeMetricFamily(f"kvstrata_l3_store_{name}", doc, labels=["node"])
            family.add_metric([self._node_id], getattr(stats, name))
            yield family
        for name, doc in _COUNTERS:
            family = CounterMetricFamily(f"kvstrata_l3_store_{name}", doc, labels=["node"])
            family.add_metric([self._node_id], getattr(stats, name))
            yield family
