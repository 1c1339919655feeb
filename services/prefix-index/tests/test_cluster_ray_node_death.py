"""Destructive (own module, own cluster, RAY_NOTES): a node dies; the surviving shard purges the
instances registered on it within 2 s of Ray marking the node dead."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from kvstrata.prefix_index import SimInstance
from kvstrata.prefix_index.cluster import ClusterIndex, ShardedPublisher, deploy_shards, shard_name
from kvstrata.prefix_index.localray import loopback_cluster

PAGE = 4


@pytest.fixture
def two_nodes() -> Iterator[tuple[Cluster, dict[str, Any]]]:
    # No skip when Ray does not start: that hid failures (RayDidNotStart fails the test).
    with loopback_cluster(num_workers=1) as cluster:
        handles = deploy_shards(PAGE, purge_period_s=0.2)
        ray.get([h.stats.remote() for h in handles.values()], timeout=120)
        yield cluster, handles


def test_dead_node_instances_are_purged_within_2s(two_nodes: tuple[Cluster, dict[str, Any]]):
    cluster, handles = two_nodes
    head_node = ray.get_runtime_context().get_node_id()
    worker_node = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] != head_node)
    index = ClusterIndex(handles, page_size=PAGE)
    head_shard = shard_name(head_node)
    victim = SimInstance("victim", capacity_pages=500, page_size=PAGE)
    keep = SimInstance("keep", capacity_pages=500, page_size=PAGE)
    pv = ShardedPublisher("victim", index, victim.tree, node_id=worker_node)
    pk = ShardedPublisher("keep", index, keep.tree, node_id=head_node)
    keyer = victim.tree.keyer
    assert keyer is not None
    on_head: list[list[bytes]] = []
    for branch in range(40):
        toks = [branch * 1000 + j for j in range(PAGE * 3)]
        victim.serve(toks)
        keep.serve(toks)
        keys = keyer.page_keys(toks)
        if index.owner(keys[0]) == head_shard:
            on_head.append(keys)
    pv.publish(victim.take_events())
    pk.publish(keep.take_events())
    assert on_head, "no branch landed on the head's shard"
    head = handles[head_shard]
    lengths, _ = ray.get(head.match_batch.remote(on_head[:1]), timeout=30)
    assert lengths[0] == {"victim": 3, "keep": 3}

    (worker,) = list(cluster.worker_nodes)
    cluster.remove_node(worker, allow_graceful=False)
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == worker_node and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "Ray never marked the node dead"
        time.sleep(0.05)
    noticed = time.monotonic()
    while "victim" not in ray.get(head.stats.remote(), timeout=30)["purged"]:
        assert time.monotonic() - noticed < 5.0, "the dead node's instance was not purged"
        time.sleep(0.05)
    assert time.monotonic() - noticed <= 2.0
    lengths, _ = ray.get(head.match_batch.remote(on_head[:1]), timeout=30)
    assert lengths[0] == {"keep": 3}
