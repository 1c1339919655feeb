"""BEHAVIOURS.md 16 and the Prometheus collector."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import EvictRequest, RadixCacheCollector, RadixKey


def test_hit_and_query_counters_count_tokens_per_tier(family: str) -> None:
    kit = make_tree(family, page_size=2, sliding_window=2)
    tree = kit.tree
    kit.put(list(range(8)))
    tree.match_prefix(RadixKey(list(range(8))))
    tree.match_prefix(RadixKey([*range(8), 50, 51, 52]))
    tree.match_prefix(RadixKey([70, 71]))
    assert tree.queried_tokens == 8 + 11 + 2
    assert tree.hit_tokens == 16
    assert tree.host_hit_tokens == 0


def test_collector_reads_the_counters_at_scrape_time() -> None:
    kit = make_tree("mamba", page_size=2)
    tree = kit.tree
    registry = CollectorRegistry()
    registry.register(RadixCacheCollector(tree, labels={"instance": "a"}))
    kit.put(list(range(8)))
    tree.match_prefix(RadixKey(list(range(8))), copy_state=True)
    tree.evict(EvictRequest.full(8))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"instance": "a", **labels})

    assert value("kvstrata_radix_queried_tokens_total") == 8
    assert value("kvstrata_radix_hit_tokens_total", tier="device") == 8
    assert value("kvstrata_radix_hit_tokens_total", tier="host") == 0
    assert value("kvstrata_radix_inserted_tokens_total") == 8
    assert value("kvstrata_radix_evicted_tokens_total", component="full") == 8
    assert value("kvstrata_radix_evicted_states_total", component="mamba") == 1
    assert value("kvstrata_radix_cached_tokens", component="full", state="evictable") == 0
    assert value("kvstrata_radix_evict_calls_total") == 1
    assert (value("kvstrata_radix_evict_seconds_total") or 0) > 0
    assert value("kvstrata_radix_nodes") == 0
    assert value("kvstrata_radix_lock_receipts") == 0
    assert value("kvstrata_radix_state_copies_total") == 1
    kit.put(list(range(4)))
    assert value("kvstrata_radix_cached_tokens", component="full", state="evictable") == 4
