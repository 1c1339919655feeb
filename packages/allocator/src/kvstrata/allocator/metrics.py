"""Prometheus collector over allocators' own counters, read at scrape time.

Nothing is registered at import: the application builds an `AllocatorCollector` and registers
it with the registry it serves (`registry.register(AllocatorCollector({"kv": allocator}))`).
The hot path pays only the integer adds in `AllocatorCounters`.

Series (labels `allocator` = the name given here, `pool` = `kv`, `full`, `swa` or `state`):
  kvstrata_allocator_capacity_slots, kvstrata_allocator_used_slots,
  kvstrata_allocator_available_slots                                   gauges, per pool
  kvstrata_allocator_alloc_calls_total, ..._failed_allocs_total, ..._allocated_slots_total,
  kvstrata_allocator_free_calls_total, ..._freed_slots_total          counters, per allocator
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.allocator.base import SlotAllocator

__all__ = ["AllocatorCollector"]

_PREFIX = "kvstrata_allocator_"

_GAUGES = (
    ("capacity_slots", "Usable slots of the pool (page 0 excluded)."),
    ("used_slots", "Slots handed out (frees pending in an open group count as used)."),
    ("available_slots", "Slots an allocation could take now."),
)

_COUNTERS = (
    ("alloc_calls", "Allocation calls (alloc, alloc_extend, alloc_decode, fork).", "alloc_calls"),
    ("failed_allocs", "Allocation calls that returned None for lack of slots.", "failed_allocs"),
    ("allocated_slots", "Slots handed out.", "allocated_slots"),
    ("free_calls", "Free calls (free, free_pages).", "free_calls"),
    ("freed_slots", "Slots returned (whole pages).", "freed_slots"),
)


class AllocatorCollector(Collector):
    """Reads `usage()` and `counters` of each named allocator on every scrape."""

    def __init__(self, allocators: Mapping[str, SlotAllocator]) -> None:
        self._allocators = dict(allocators)

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so registering does not trigger a scrape."""
        for suffix, doc in _GAUGES:
            yield GaugeMetricFamily(_PREFIX + suffix, doc, labels=("allocator", "pool"))
        for suffix, doc, _ in _COUNTERS:
            yield CounterMetricFamily(_PREFIX + suffix, doc, labels=("allocator",))

    def collect(self) -> Iterator[Metric]:
        gauges = {
            suffix: GaugeMetricFamily(_PREFIX + suffix, doc, labels=("allocator", "pool"))
            for suffix, doc in _GAUGES
        }
        counters = [
            (CounterMetricFamily(_PREFIX + suffix, doc, labels=("allocator",)), field)
            for suffix, doc, field in _COUNTERS
        ]
        for name, allocator in self._allocators.items():
            for usage in allocator.usage():
                labels = (name, usage.pool)
                gauges["capacity_slots"].add_metric(labels, usage.capacity_slots)
                gauges["used_slots"].add_metric(labels, usage.used_slots)
                gauges["available_slots"].add_metric(labels, usage.available_slots)
            values = allocator.counters
            for family, field in counters:
                family.add_metric((name,), getattr(values, field))
        yield from gauges.values()
        for family, _ in counters:
            yield family
