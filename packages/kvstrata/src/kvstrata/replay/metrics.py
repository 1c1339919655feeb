"""Prometheus metrics of a replay, read from `ReplayEngine`'s plain counters at scrape time.

Nothing is registered at import: register a collector on the registry you choose, e.g.
`registry.register(ReplayCollector(engine, labels={"family": "mha"}))`. The tree, allocators and
pools export their own metrics through their packages' collectors; this one covers what only
the replay knows: prompt tokens as the engine saw them, usable hits, and where the time went.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.replay.engine import ReplayEngine


class ReplayCollector(Collector):
    """Exports one engine's counters, all counters named `kvstrata_replay_*`:

    - `requests_total`, `prompt_tokens_total`, `computed_tokens_total`,
      `evicted_tokens_total` (full KV evicted from the device);
    - `hit_tokens_total{tier}` (usable hits by the tier they were on when the request was
      scheduled: `device`, and with tiers `host` and `storage`; summed over `tier`, every hit);
    - `evict_calls_total` (evictions the engine asked for when an allocation fell short);
    - `seconds_total{phase}`: `cache` (match, lock, allocate, evict, insert, free, unlock) and
      `forward` (the stand-in forward's KV writes);
    The tiered cache's own transfers are exported by
    `kvstrata.unified_radix_cache.tier_metrics.TierCacheCollector`.
    """

    def __init__(self, engine: ReplayEngine, *, labels: Mapping[str, str] | None = None) -> None:
        self._engine = engine
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        counters = engine.counters
        names = list(self._labels)
        values = list(self._labels.values())
        for name, doc, value in (
            ("requests", "Requests replayed.", counters.requests),
            ("prompt_tokens", "Prompt tokens of the replayed requests.", counters.prompt_tokens),
            ("computed_tokens", "Prompt tokens whose KV was written.", counters.computed_tokens),
            ("evicted_tokens", "Full KV tokens evicted from the device.", counters.evicted_tokens),
            ("evict_calls", "Evictions asked for by short allocations.", counters.evict_calls),
        ):
            family = CounterMetricFamily(f"kvstrata_replay_{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
        seconds = CounterMetricFamily(
            "kvstrata_replay_seconds",
            "Time spent per phase of the replay.",
            labels=[*names, "phase"],
        )
        seconds.add_metric([*values, "cache"], counters.cache_seconds)
        seconds.add_metric([*values, "forward"], counters.kv_write_seconds)
        yield seconds
        hits = CounterMetricFamily(
            "kvstrata_replay_hit_tokens",
            "Reused prompt tokens by the tier they were on when the request was scheduled.",
            labels=[*names, "tier"],
        )
        if engine.tiers is None:
            hits.add_metric([*values, "device"], counters.hit_tokens)
        else:
            hits.add_metric([*values, "device"], counters.device_hit_tokens)
            hits.add_metric([*values, "host"], counters.host_hit_tokens)
            hits.add_metric([*values, "storage"], counters.storage_hit_tokens)
        yield hits
