"""Prometheus metrics of a radix tree, read from the tree's plain counters at scrape time.

Nothing is registered at import: the application registers a collector on the registry it
chooses, e.g. `registry.register(RadixCacheCollector(tree, labels={"instance": "a"}))`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.tree import UnifiedRadixCache


class RadixCacheCollector(Collector):
    """Exports one tree's counters (all `kvstrata_radix_*`):

    - `queried_tokens_total`, `hit_tokens_total{tier}` (device; host reserved for tiers),
      `inserted_tokens_total`;
    - `evicted_tokens_total{component}` / `evicted_states_total{component}` (cascades included),
      `evict_calls_total`, `evict_seconds_total`;
    - `cached_tokens{component,state}` / `cached_states{component,state}` (evictable, protected);
    - `nodes`, `lock_receipts`, `state_copies_total` (Mamba copy-on-write).
    """

    def __init__(self, tree: UnifiedRadixCache, *, labels: Mapping[str, str] | None = None) -> None:
        self._tree = tree
        self._labels = dict(labels or {})

    def _names(self, *extra: str) -> list[str]:
        return [*self._labels, *extra]

    def _values(self, *extra: str) -> list[str]:
        return [*self._labels.values(), *extra]

    def collect(self) -> Iterator[Metric]:
        tree = self._tree
        queried = CounterMetricFamily(
            "kvstrata_radix_queried_tokens",
            "Tokens looked up by match_prefix.",
            labels=self._names(),
        )
        queried.add_metric(self._values(), tree.queried_tokens)
        yield queried
        hits = CounterMetricFamily(
            "kvstrata_radix_hit_tokens",
            "Matched prefix tokens, per tier.",
            labels=self._names("tier"),
        )
        hits.add_metric(self._values("device"), tree.hit_tokens)
        hits.add_metric(self._values("host"), tree.host_hit_tokens)
        yield hits
        inserted = CounterMetricFamily(
            "kvstrata_radix_inserted_tokens", "Tokens adopted by inserts.", labels=self._names()
        )
        inserted.add_metric(self._values(), tree.inserted_tokens)
        yield inserted
        families: dict[str, tuple[CounterMetricFamily, GaugeMetricFamily]] = {}
        for unit in sorted({c.unit for c in tree.components}):
            families[unit] = (
                CounterMetricFamily(
                    f"kvstrata_radix_evicted_{unit}",
                    f"Evicted {unit} per component (cascades included).",
                    labels=self._names("component"),
                ),
                GaugeMetricFamily(
                    f"kvstrata_radix_cached_{unit}",
                    f"Cached {unit} per component, evictable or protected by a lock.",
                    labels=self._names("component", "state"),
                ),
            )
        for component in tree.components:
            evicted, cached = families[component.unit]
            evicted.add_metric(self._values(component.name), component.evicted_total)
            cached.add_metric(self._values(component.name, "evictable"), component.evictable_size)
            cached.add_metric(self._values(component.name, "protected"), component.protected_size)
        for evicted, cached in families.values():
            yield evicted
            yield cached
        calls = CounterMetricFamily(
            "kvstrata_radix_evict_calls", "evict() calls.", labels=self._names()
        )
        calls.add_metric(self._values(), tree.evict_calls)
        yield calls
        seconds = CounterMetricFamily(
            "kvstrata_radix_evict_seconds", "Time spent in evict().", labels=self._names()
        )
        seconds.add_metric(self._values(), tree.evict_seconds)
        yield seconds
        nodes = GaugeMetricFamily(
            "kvstrata_radix_nodes", "Nodes in the tree.", labels=self._names()
        )
        nodes.add_metric(self._values(), tree.num_nodes)
        yield nodes
        receipts = GaugeMetricFamily(
            "kvstrata_radix_lock_receipts", "Outstanding lock receipts.", labels=self._names()
        )
        receipts.add_metric(self._values(), tree.num_locked)
        yield receipts
        copies = CounterMetricFamily(
            "kvstrata_radix_state_copies",
            "Copy-on-write state copies made by matches.",
            labels=self._names(),
        )
        copies.add_metric(
            self._values(), sum(getattr(c, "copies_total", 0) for c in tree.components)
        )
        yield copies
