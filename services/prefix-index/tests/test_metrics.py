"""IndexCollector over an in-process IndexShard: size, lookups, latency buckets and events by
kind follow what the shard did (no Ray)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.prefix_index.cluster import IndexShard, deploy_shards
from kvstrata.prefix_index.errors import InvalidParameter
from kvstrata.prefix_index.metrics import LOOKUP_BUCKETS, IndexCollector, ShardCounters
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, encode_events

PAGE = 16


def _scrape(shard: IndexShard) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(shard.collector())
    out: dict[str, float] = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_shard_metrics_follow_the_shard() -> None:
    shard = IndexShard(PAGE)
    keys = shard.index.page_keys(list(range(4 * PAGE)))
    stored = BlockStored(page_keys=tuple(keys), parent_key=None, tokens_per_page=PAGE)
    removed = BlockRemoved(page_keys=(keys[3],))
    assert shard.apply_batches(
        [("e0", 0, encode_events([stored])), ("e0", 1, encode_events([removed]))]
    ) == [True, True]
    shard.apply_batches([("e0", 5, encode_events([removed]))])  # a gap: not applied, not counted
    shard.load_dump("e0", encode_events([stored]), 6)
    shard.match_batch([keys[:2], keys, [b"\x00" * len(keys[0])]])
    got = _scrape(shard)
    assert got["kvstrata_prefix_index_entries"] == 4
    assert got["kvstrata_prefix_index_instances"] == 1
    assert got["kvstrata_prefix_index_gaps_total"] == 1
    assert got["kvstrata_prefix_index_lookups_total"] == 3
    assert got['kvstrata_prefix_index_events_total{kind="stored"}'] == 2
    assert got['kvstrata_prefix_index_events_total{kind="removed"}'] == 1
    assert got['kvstrata_prefix_index_events_total{kind="cleared"}'] == 0
    assert got['kvstrata_prefix_index_lookup_seconds_bucket{le="+Inf"}'] == 1
    assert got["kvstrata_prefix_index_lookup_seconds_count"] == 1
    assert got["kvstrata_prefix_index_lookup_seconds_sum"] > 0
    assert not [name for name in got if "node=" in name]


def test_lookup_buckets_are_cumulative() -> None:
    counters = ShardCounters()
    for seconds in (0.0, LOOKUP_BUCKETS[0], LOOKUP_BUCKETS[3] * 0.9, 5.0):
        counters.lookup_batch(2, seconds)
    shard = IndexShard(PAGE)
    registry = CollectorRegistry()
    registry.register(IndexCollector(shard.index, counters))
    text = generate_latest(registry).decode()
    assert f'kvstrata_prefix_index_lookup_seconds_bucket{{le="{LOOKUP_BUCKETS[0]!r}"}} 2.0' in text
    assert f'kvstrata_prefix_index_lookup_seconds_bucket{{le="{LOOKUP_BUCKETS[3]!r}"}} 3.0' in text
    assert 'kvstrata_prefix_index_lookup_seconds_bucket{le="+Inf"} 4.0' in text
    assert "kvstrata_prefix_index_lookups_total 8.0" in text


def test_reference_collectors_build_without_ray() -> None:
    (collector,) = IndexCollector.reference_collectors()
    names = {family.name for family in collector.collect()}
    assert {"kvstrata_prefix_index_entries", "kvstrata_prefix_index_lookup_seconds"} <= names


def test_deploy_shards_refuses_bad_arguments_before_touching_ray() -> None:
    with pytest.raises(InvalidParameter, match="page_size"):
        deploy_shards(0, metrics_port=0)
    with pytest.raises(InvalidParameter, match="metrics_port"):
        deploy_shards(16, metrics_port=65536)
