"""Metrics of the host tier: plain counters on the pools, a collector that reads them at scrape.

Nothing here registers anything: the application builds `HostPoolCollector(...)` and registers it
with the registry it serves (`registry.register(collector)`).

    kvstrata_host_transfer_bytes_total / _calls_total / _pages_total{direction}
        direction d2h: backup (device -> host), h2d: layer loads (host -> device)
    kvstrata_host_transfer_seconds{direction}                       latency histogram
    kvstrata_host_pool_capacity_bytes, kvstrata_host_pool_capacity_tokens
    kvstrata_host_pool_free_tokens, kvstrata_host_pool_used_tokens  (pools given an allocator)

Labels: `pool` (the name the application gives each pool), `family`, `layout`, and `direction`
(the same values as the tier controller's and the tiered cache's `direction`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Re-exported: the counters live in `stats` (which base.py fills), the histogram in kvstrata.core.
from kvstrata.core.histogram import HistogramSnapshot, LatencyHistogram
from kvstrata.pool_host.base import HostPool
from kvstrata.pool_host.errors import UnknownPoolName
from kvstrata.pool_host.slots import HostSlotAllocator
from kvstrata.pool_host.stats import LATENCY_BOUNDS, HostPoolStats, TransferCounters

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = [
    "LATENCY_BOUNDS",
    "HistogramSnapshot",
    "HostPoolCollector",
    "HostPoolStats",
    "LatencyHistogram",
    "TransferCounters",
]


class HostPoolCollector(Collector):
    """Reads the counters of named host pools (and, optionally, their slot allocators) whenever
    the registry is scraped. Holding the collector keeps the pools alive."""

    def __init__(
        self,
        pools: Mapping[str, HostPool],
        *,
        allocators: Mapping[str, HostSlotAllocator] | None = None,
    ) -> None:
        self._pools = dict(pools)
        self._allocators = dict(allocators or {})
        unknown = set(self._allocators) - set(self._pools)
        if unknown:
            raise UnknownPoolName(f"allocators given for pools that were not: {sorted(unknown)}")

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "family", "layout"]
        moved = [*labels, "direction"]
        fams = {
            name: CounterMetricFamily(f"kvstrata_host_transfer_{name}", doc, labels=moved)
            for name, doc in (
                ("bytes", "Bytes copied: d2h by backup, h2d by layer loads"),
                ("calls", "Copy calls: d2h backups, h2d layer loads"),
                ("pages", "Pages copied (h2d: one per page per layer load)"),
            )
        }
        hist = HistogramMetricFamily(
            "kvstrata_host_transfer_seconds", "Latency of one copy call", labels=moved
        )
        cap_bytes = GaugeMetricFamily(
            "kvstrata_host_pool_capacity_bytes", "Bytes of host memory held", labels=labels
        )
        cap_tokens = GaugeMetricFamily(
            "kvstrata_host_pool_capacity_tokens", "Token slots of the host pool", labels=labels
        )
        free_tokens = GaugeMetricFamily(
            "kvstrata_host_pool_free_tokens", "Free host token slots", labels=labels
        )
        used_tokens = GaugeMetricFamily(
            "kvstrata_host_pool_used_tokens", "Allocated host token slots", labels=labels
        )
        for pool_name, pool in self._pools.items():
            stats = pool.stats()
            values = [pool_name, stats.family, stats.layout]
            for direction, counters in (("d2h", stats.d2h), ("h2d", stats.h2d)):
                fams["bytes"].add_metric([*values, direction], counters.bytes)
                fams["calls"].add_metric([*values, direction], counters.calls)
                fams["pages"].add_metric([*values, direction], counters.pages)
                hist.add_metric(
                    [*values, direction],
                    buckets=counters.latency.cumulative(),
                    sum_value=counters.latency.sum_seconds,
                )
            cap_bytes.add_metric(values, stats.capacity_bytes)
            cap_tokens.add_metric(values, stats.capacity_tokens)
            allocator = self._allocators.get(pool_name)
            if allocator is not None:
                free = allocator.available_size()
                free_tokens.add_metric(values, free)
                used_tokens.add_metric(values, allocator.size - free)
        yield from fams.values()
        yield hist
        yield from (cap_bytes, cap_tokens, free_tokens, used_tokens)
