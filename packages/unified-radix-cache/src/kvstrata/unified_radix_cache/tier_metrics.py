"""Prometheus metrics of a `HierarchicalCache`, read from its `TierCounters` at scrape time.

Nothing is registered at import: `registry.register(TierCacheCollector(cache, labels={...}))`.
Each tier's own tree is exported by `RadixCacheCollector` (the host tree with e.g.
`labels={"tier": "host"}`); this collector adds what crosses tiers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache


class TierCacheCollector(Collector):
    """Exports (all `kvstrata_tiered_cache_*`):

    - `hit_tokens_total{tier}`: device, host, storage (prefetched into the host);
    - `queried_tokens_total`, `loaded_tokens_total` (host -> device), `written_tokens_total`
      (device -> host), `backed_up_tokens_total` (host -> storage), `host_evicted_tokens_total`;
    - `transfer_bytes_total{direction}`: d2h, h2d, storage_get, storage_set;
    - `failed_transfers_total`, `short_prefetches_total`, `prefetches_total{outcome}` (started,
      skipped), `load_backs_refused_total`, `transfer_timeouts_total`,
      `transfer_wait_seconds_total`;
    - `host_tokens{state}` (free, evictable, protected), `transfers_in_flight`;
    - per other component, the gauge its tier hooks name (`ComponentTransfer.metric`; free,
      held: its host slots on nodes), e.g. `host_states{state}` (Mamba), `host_swa_tokens{state}`
      (SWA).
    """

    def __init__(
        self, cache: HierarchicalCache, *, labels: Mapping[str, str] | None = None
    ) -> None:
        self._cache = cache
        self._labels = dict(labels or {})

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(
            f"kvstrata_tiered_cache_{name}", doc, labels=list(self._labels)
        )
        metric.add_metric(list(self._labels.values()), value)
        return metric

    def _by(
        self, name: str, doc: str, label: str, values: Mapping[str, float], *, gauge: bool = False
    ) -> Metric:
        family = GaugeMetricFamily if gauge else CounterMetricFamily
        metric = family(f"kvstrata_tiered_cache_{name}", doc, labels=[*self._labels, label])
        for key, value in values.items():
            metric.add_metric([*self._labels.values(), key], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        cache = self._cache
        c = cache.counters
        yield self._by(
            "hit_tokens",
            "Matched prefix tokens, per tier.",
            "tier",
            {
                "device": c.device_hit_tokens,
                "host": c.host_hit_tokens,
                "storage": c.storage_hit_tokens,
            },
        )
        yield self._counter("queried_tokens", "Tokens looked up.", c.queried_tokens)
        yield self._counter("loaded_tokens", "Tokens loaded back host -> device.", c.loaded_tokens)
        yield self._counter("written_tokens", "Tokens written device -> host.", c.written_tokens)
        yield self._counter(
            "backed_up_tokens", "Tokens stored host -> storage.", c.backed_up_tokens
        )
        yield self._counter(
            "host_evicted_tokens", "Tokens evicted from the host tier.", c.host_evicted_tokens
        )
        yield self._by(
            "transfer_bytes",
            "Bytes committed per direction.",
            "direction",
            {
                "d2h": c.bytes_d2h,
                "h2d": c.bytes_h2d,
                "storage_get": c.bytes_storage_get,
                "storage_set": c.bytes_storage_set,
            },
        )
        yield self._counter("failed_transfers", "Transfers acknowledged failed.", c.failed_ops)
        yield self._counter(
            "short_prefetches", "Prefetches that delivered fewer pages.", c.short_prefetches
        )
        yield self._by(
            "prefetches",
            "Prefetches started or skipped (host share or room).",
            "outcome",
            {"started": c.prefetches_started, "skipped": c.prefetches_skipped},
        )
        yield self._counter(
            "load_backs_refused", "Load-backs without device room.", c.load_backs_refused
        )
        yield self._counter(
            "transfer_timeouts",
            "Waits that gave up on a transfer not acknowledged in time.",
            c.transfer_timeouts,
        )
        yield self._counter(
            "transfer_wait_seconds", "Time callers waited for transfers.", c.transfer_wait_seconds
        )
        host = cache.tier
        # Host slots by state: Full's, then each other component's under its hooks' name.
        gauges: list[tuple[str, str, dict[str, float]]] = [
            (
                "host_tokens",
                "Host tier tokens by state.",
                {
                    "free": cache.host_allocator.available_size(),
                    "evictable": host.evictable_size,
                    "protected": host.protected_size,
                },
            )
        ]
        for name, transfer in cache.core.transfers.items():
            held = cache.device_tree.component(name).host_held_size
            free = cache.component_hosts[name].available_size()
            values: dict[str, float] = {"free": free, "held": held}
            gauges.append((*transfer.metric(), values))
        for gauge, doc, values in gauges:
            yield self._by(gauge, doc, "state", values, gauge=True)
        inflight = GaugeMetricFamily(
            "kvstrata_tiered_cache_transfers_in_flight",
            "Writes, backups and prefetches not yet acknowledged.",
            labels=list(self._labels),
        )
        inflight.add_metric(list(self._labels.values()), cache.num_pending)
        yield inflight
