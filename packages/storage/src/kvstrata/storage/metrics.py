"""Latency histograms and the Prometheus collector of kvstrata.storage.

Backends keep plain integer counters and fixed-bucket histograms (an integer add on the hot path);
`StorageCollector` turns `Storage.stats()` into metric families at scrape time. Nothing here
registers itself anywhere: the application chooses the registry.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from kvstrata.storage.base import Storage

#: Upper bounds (seconds) of the latency buckets: from a page-cache hit of a small page (tens of
#: microseconds) to a batch stuck behind a slow disk (seconds). The +Inf bucket is implicit.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class HistogramSnapshot:
    """A histogram at one instant. `counts[i]` counts observations in bucket i alone (not
    cumulative); the last entry is the +Inf bucket, so `len(counts) == len(bounds) + 1`."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_seconds: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus-style `(le, cumulative count)` pairs, ending with `("+Inf", count)`."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class LatencyHistogram:
    """Fixed-bucket latency histogram. Not thread-safe by itself: the owner serialises `observe`
    (the storage base class does so under its counters lock)."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        assert list(bounds) == sorted(bounds), "histogram bounds must be increasing"
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """Add one observation. Mutates the bucket counts and the sum; O(log buckets)."""
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            bounds=self._bounds, counts=tuple(self._counts), sum_seconds=self._sum
        )


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
            "hits": ("kvstrata_storage_hits", "batch_get pages found."),
            "misses": ("kvstrata_storage_misses", "batch_get pages not found or unreadable."),
            "corrupt_pages": ("kvstrata_storage_corrupt_pages", "Pages that failed a check."),
            "race_misses": (
                "kvstrata_storage_race_misses",
                "Misses because another process removed or replaced a page while it was read.",
            ),
            "evictions": ("kvstrata_storage_evictions", "Pages evicted for capacity."),
            "write_failures": ("kvstrata_storage_write_failures", "Pages refused or failed."),
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
