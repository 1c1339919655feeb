"""Prometheus metrics of one prefix index shard, read at scrape time.

The shard keeps plain counters (`ShardCounters`: an integer add per lookup batch and per event,
and one bucket add per lookup batch); `IndexCollector` turns them and the index's size into
`kvstrata_prefix_index_*` families when Prometheus scrapes. Each shard actor serves its own
registry with `prometheus_client` on its node (9402 in ops/; see `deploy_shards`). The node is
not a label: the scrape attaches `instance` and `node` (ops/prometheus/prometheus.yml).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvstrata.prefix_index.index import PrefixIndex
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

#: Upper bounds (seconds) of the lookup latency buckets; +Inf is implied.
LOOKUP_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0,
)  # fmt: skip

#: Event kinds, the values of the `kind` label of `kvstrata_prefix_index_events_total`.
EVENT_KINDS: dict[type, str] = {
    BlockStored: "stored",
    BlockRemoved: "removed",
    AllBlocksCleared: "cleared",
}


@dataclass
class ShardCounters:
    """What a shard counts on its hot paths. `lookup_buckets[i]` counts lookup batches that took
    at most LOOKUP_BUCKETS[i] seconds and more than the bound before (the last: more than all)."""

    lookups: int = 0
    lookup_batches: int = 0
    lookup_seconds: float = 0.0
    lookup_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOOKUP_BUCKETS) + 1))
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KINDS.values(), 0))

    def lookup_batch(self, queries: int, seconds: float) -> None:
        self.lookups += queries
        self.lookup_batches += 1
        self.lookup_seconds += seconds
        self.lookup_buckets[bisect.bisect_left(LOOKUP_BUCKETS, seconds)] += 1

    def count_events(self, events: list[KVEvent]) -> None:
        counts = self.events
        for event in events:
            counts[EVENT_KINDS[type(event)]] += 1


class IndexCollector(Collector):
    """`kvstrata_prefix_index_*`: entries, instances and evictions of one shard's index, and
    its lookups, lookup latency and events by kind."""

    def __init__(self, index: PrefixIndex, counters: ShardCounters) -> None:
        self._index = index
        self._counters = counters

    @classmethod
    def reference_collectors(cls) -> list[Collector]:
        """An index that stored, removed and looked up a page (docs/metrics.md)."""
        index = PrefixIndex(16)
        counters = ShardCounters()
        keys = index.page_keys(list(range(32)))
        stored: list[KVEvent] = [
            BlockStored(page_keys=tuple(keys), parent_key=None, tokens_per_page=16),
            BlockRemoved(page_keys=(keys[1],)),
        ]
        cleared: list[KVEvent] = [AllBlocksCleared()]
        index.apply("engine-0", stored)
        index.apply("engine-1", cleared)
        counters.count_events(stored + cleared)
        index.match_lengths(keys)
        counters.lookup_batch(1, 2e-5)
        return [cls(index, counters)]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        stats = self._index.stats()
        c = self._counters
        yield GaugeMetricFamily(
            "kvstrata_prefix_index_entries",
            "Distinct page keys the shard's index holds.",
            value=stats.num_entries,
        )
        yield GaugeMetricFamily(
            "kvstrata_prefix_index_instances",
            "Engine instances with entries in the shard's index.",
            value=stats.num_instances,
        )
        yield CounterMetricFamily(
            "kvstrata_prefix_index_evicted_entries",
            "Entries dropped to keep the index under max_entries.",
            value=stats.evicted_entries,
        )
        yield CounterMetricFamily(
            "kvstrata_prefix_index_gaps",
            "Event sequence gaps seen (each drops the instance's entries until a dump).",
            value=stats.gaps,
        )
        yield CounterMetricFamily(
            "kvstrata_prefix_index_lookups",
            "Prefix lookups (one per query of a match batch).",
            value=c.lookups,
        )
        events = CounterMetricFamily(
            "kvstrata_prefix_index_events", "KV events applied, by kind.", labels=["kind"]
        )
        for kind, n in c.events.items():
            events.add_metric([kind], n)
        yield events
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*LOOKUP_BUCKETS, float("inf")), c.lookup_buckets, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        yield HistogramMetricFamily(
            "kvstrata_prefix_index_lookup_seconds",
            "Time a shard took to answer one match batch.",
            buckets=cumulative,
            sum_value=c.lookup_seconds,
        )
