"""Prometheus metrics of one store, read from `StoreCore.stats()` at scrape time (nothing on the
hot path). The store actor serves them on its own registry (`StoreActor` binds 127.0.0.1 by
default: a scraper on the node, or a Ray/Prometheus sidecar, reaches it; pass another address
to expose it).

Names follow docs/metrics.md: the store's two levels are one family each with a `medium`
label (`memory`, `disk`); bytes moved are `kvstrata_l3_store_transfer_bytes_total{direction}`
(`storage_set` in, `storage_get` out) like every other layer; pages dropped without a disk
copy are `kvstrata_l3_store_evicted_pages_total`. The node is not a label: Prometheus attaches
`instance` and `node` to every series of the target (ops/prometheus/prometheus.yml).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstrata.l3_store.arena import ALIGNMENT
from kvstrata.l3_store.core import CoreStats, StoreCore, StoreParams

#: (exposed name, help, CoreStats field for memory, for disk)
_BY_MEDIUM = (
    ("pages", "Pages stored, per medium.", "memory_pages", "disk_pages"),
    (
        "used_bytes",
        "Bytes held by pages (and, in memory, reservations), per medium.",
        "memory_used_bytes",
        "disk_used_bytes",
    ),
    ("capacity_bytes", "Byte budget, per medium.", "memory_capacity_bytes", "disk_capacity_bytes"),
)
_GAUGES = (
    ("active_leases", "Leases pinning pages under readers.", "active_leases"),
    ("active_reservations", "Writes reserved and not yet committed.", "active_reservations"),
)
#: (name without _total, help, CoreStats field)
_COUNTERS = (
    ("missed_pages", "Pages asked for and not stored.", "misses"),
    ("written_pages", "Pages stored.", "pages_written"),
    ("read_pages", "Pages handed to readers.", "pages_read"),
    ("failed_write_pages", "Pages refused (no room, checksum mismatch).", "write_failures"),
    (
        "checksum_failed_pages",
        "Pages whose bytes did not match the writer's checksum.",
        "checksum_failures",
    ),
    ("spilled_pages", "Pages moved from memory to disk.", "spills"),
    ("evicted_pages", "Pages evicted without a disk copy.", "drops"),
    ("expired_grants", "Leases and reservations dropped at their deadline.", "expired"),
    ("calls", "Store calls.", "operations"),
)


class StoreCollector(Collector):
    """`kvstrata_l3_store_*` gauges and counters of one store (the scrape adds the node)."""

    def __init__(self, stats: Callable[[], CoreStats]) -> None:
        self._stats = stats

    @classmethod
    def reference_collectors(cls) -> list[Collector]:
        """A small in-memory store that stored, read and missed a page (docs/metrics.md)."""
        core = StoreCore(
            StoreParams(memory_bytes=2 * ALIGNMENT), arena=memoryview(bytearray(2 * ALIGNMENT))
        )
        key = b"reference-page-0"
        core.write([key], [bytes(ALIGNMENT)])
        core.read([key, b"reference-page-1"])
        return [cls(core.stats)]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        for name, doc, memory, disk in _BY_MEDIUM:
            family = GaugeMetricFamily(f"kvstrata_l3_store_{name}", doc, labels=["medium"])
            family.add_metric(["memory"], getattr(stats, memory))
            family.add_metric(["disk"], getattr(stats, disk))
            yield family
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(f"kvstrata_l3_store_{name}", doc, value=getattr(stats, field))
        hits = CounterMetricFamily(
            "kvstrata_l3_store_hit_pages",
            "Pages found, per medium they were read from.",
            labels=["medium"],
        )
        hits.add_metric(["memory"], stats.hits_memory)
        hits.add_metric(["disk"], stats.hits_disk)
        yield hits
        moved = CounterMetricFamily(
            "kvstrata_l3_store_transfer_bytes",
            "Page bytes moved: storage_set stored, storage_get handed to readers.",
            labels=["direction"],
        )
        moved.add_metric(["storage_set"], stats.bytes_written)
        moved.add_metric(["storage_get"], stats.bytes_read)
        yield moved
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(f"kvstrata_l3_store_{name}", doc, value=getattr(stats, field))
