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

    def _plain(
        self,
        family: type[CounterMetricFamily | GaugeMetricFamily],
        name: str,
        doc: str,
        value: float,
    ) -> Metric:
        """A family with only the collector's labels, holding one sample."""
        metric = family(f"kvstrata_radix_{name}", doc, labels=self._names())
        metric.add_metric(self._values(), value)
        return metric

    def collect(self) -> Iterator[Metric]:
        tree = self._tree
        yield self._plain(
            CounterMetricFamily,
            "queried_tokens",
            "Tokens looked up by match_prefix.",
            tree.queried_tokens,
        )
        hits = CounterMetricFamily(
            "kvstrata_radix_hit_tokens",
            "Matched prefix tokens, per tier.",
            labels=self._names("tier"),
        )
        hits.add_metric(self._values("device"), tree.hit_tokens)
        hits.add_metric(self._values("host"), tree.host_hit_tokens)
        yield hits
        yield self._plain(
            CounterMetricFamily,
            "inserted_tokens",
            "Tokens adopted by inserts.",
            tree.inserted_tokens,
        )
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
        yield self._plain(CounterMetricFamily, "evict_calls", "evict() calls.", tree.evict_calls)
        yield self._plain(
            CounterMetricFamily, "evict_seconds", "Time spent in evict().", tree.evict_seconds
        )
        yield self._plain(GaugeMetricFamily, "nodes", "Nodes in the tree.", tree.num_nodes)
        yield self._plain(
            GaugeMetricFamily, "lock_receipts", "Outstanding lock receipts.", tree.num_locked
        )
        yield self._plain(
            CounterMetricFamily,
            "state_copies",
            "Copy-on-write state copies made by matches.",
            sum(getattr(c, "copies_total", 0) for c in tree.components),
        )
