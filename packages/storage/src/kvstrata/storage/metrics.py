"""The Prometheus collector of kvstrata.storage.

Backends keep plain integer counters and fixed-bucket histograms (`kvstrata.core.histogram`, an
integer add on the hot path, buckets `base.LATENCY_BUCKETS_S`); `StorageCollector` turns
`Storage.stats()` into metric families at scrape time. Nothing here registers itself anywhere:
the application chooses the registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Re-exported: the histogram's one implementation lives in kvstrata.core.
from kvstrata.core.histogram import HistogramSnapshot, LatencyHistogram
from kvstrata.storage.base import LATENCY_BUCKETS_S, Storage

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["LATENCY_BUCKETS_S", "HistogramSnapshot", "LatencyHistogram", "StorageCollector"]


class StorageCollector(Collector):
    """Exports the counters of named storages, read at scrape time.

    `storages` maps the value of the `storage` label to a backend, e.g.
    `{"l3-file": file_storage}`. Register it on a registry of your choice:
    `registry.register(StorageCollector({"l3": storage}))`.
    """

    def __init__(self, storages: Mapping[str, Storage]) -> None:
        self._storages = dict(storages)

    def collect(self) -> Iterator[Metric]:
        label = ["storage"]
        gauges = {
            "pages": GaugeMetricFamily(
                "kvstrata_storage_pages", "Pages currently stored.", labels=label
            ),
            "used_bytes": GaugeMetricFamily(
                "kvstrata_storage_used_bytes", "Bytes of stored pages.", labels=label
            ),
            "capacity_bytes": GaugeMetricFamily(
                "kvstrata_storage_capacity_bytes", "Byte capacity of the store.", labels=label
            ),
        }
        counters = {
            "pages_read": ("kvstrata_storage_read_pages", "Pages read into caller buffers."),
            "bytes_read": ("kvstrata_storage_read_bytes", "Payload bytes read."),
            "pages_written": ("kvstrata_storage_written_pages", "Pages written."),
            "bytes_written": ("kvstrata_storage_written_bytes", "Payload bytes written."),
            "hits": ("kvstrata_storage_hit_pages", "batch_get pages found."),
            "misses": ("kvstrata_storage_missed_pages", "batch_get pages not found or unreadable."),
            "corrupt_pages": ("kvstrata_storage_corrupt_pages", "Pages that failed a check."),
            "evictions": ("kvstrata_storage_evicted_pages", "Pages evicted for capacity."),
            "write_failures": ("kvstrata_storage_failed_write_pages", "Pages refused or failed."),
        }
        counter_families = {
            field: CounterMetricFamily(name, doc, labels=label)
            for field, (name, doc) in counters.items()
        }
        latency = HistogramMetricFamily(
            "kvstrata_storage_operation_seconds",
            "Latency of one batch call, per operation.",
            labels=["storage", "operation"],
        )
        for name, storage in self._storages.items():
            stats = storage.stats()
            gauges["pages"].add_metric([name], stats.num_pages)
            gauges["used_bytes"].add_metric([name], stats.used_bytes)
            gauges["capacity_bytes"].add_metric([name], stats.capacity_bytes)
            for field, family in counter_families.items():
                family.add_metric([name], getattr(stats, field))
            for operation, hist in stats.latency.items():
                latency.add_metric(
                    [name, operation], buckets=hist.cumulative(), sum_value=hist.sum_seconds
                )
        yield from gauges.values()
        yield from counter_families.values()
        yield latency
