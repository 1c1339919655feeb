"""Shard actors on a 2-node loopback Ray cluster: branch-sharded lookups, routing, a shard
restart rebuilt from dumps (answering partially meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from kvstrata.prefix_index import PrefixIndex, Router, SimInstance
from kvstrata.prefix_index.cluster import (
    ClusterIndex,
    ShardedPublisher,
    deploy_shards,
    remove_shards,
)
from kvstrata.prefix_index.errors import ShardUnavailable
from kvstrata.prefix_index.localray import loopback_cluster, replay_ops_on_cluster
from kvstrata.prefix_index.opstream import build_op_stream
from kvstrata.unified_radix_cache import BlockRemoved

PAGE = 4
PURGE_PERIOD_S = 0.2


@pytest.fixture(scope="module")
def shards() -> Iterator[dict[str, Any]]:
    # No skip when Ray does not start: that hid every failure below (RayDidNotStart fails).
    with loopback_cluster(num_workers=1):
        handles = deploy_shards(
            PAGE, rebuild_grace_s=5.0, metrics_port=0, purge_period_s=PURGE_PERIOD_S
        )
        ray.get([h.stats.remote() for h in handles.values()], timeout=120)
        yield handles
        assert remove_shards() == len(handles)
        assert remove_shards() == 0


class Engine:
    """Stands in for an engine instance actor (only its life matters here)."""

    def ping(self) -> str:
        return "ok"


def prompt(branch: int, n_pages: int, tail: int = 0) -> list[int]:
    toks = [branch * 1000 + j for j in range(PAGE * n_pages)]
    return toks + [900_000 + tail + j for j in range(PAGE)]


def test_branch_sharded_routing(shards: dict[str, Any]) -> None:
    assert len(shards) == 2
    cluster = ClusterIndex(shards, page_size=PAGE)
    node = ray.get_runtime_context().get_node_id()
    names = ["a", "b", "c"]
    instances = {n: SimInstance(n, capacity_pages=200, page_size=PAGE) for n in names}
    pubs = {n: ShardedPublisher(n, cluster, instances[n].tree, node_id=node) for n in names}
    router = Router(cluster, names, policy="cache_aware", load_weight=0.1)
    keyer = instances["a"].tree.keyer
    assert keyer is not None
    first_choice: dict[int, str] = {}
    for branch in range(12):
        toks = prompt(branch, 6)
        decision = router.route(keyer.page_keys(toks))
        instances[decision.instance].serve(toks)
        pubs[decision.instance].publish(instances[decision.instance].take_events())
        first_choice[branch] = decision.instance
    for branch in range(12):
        toks = prompt(branch, 6, tail=1)
        decision = router.route(keyer.page_keys(toks))
        # The second request of a shared prefix goes where the prefix is.
        assert decision.instance == first_choice[branch]
        assert decision.matched_pages == 6
    stats = cluster.stats()
    assert all(s["entries"] > 0 for s in stats.values()), stats  # both shards hold branches
    assert 1.0 <= cluster.skew() < 2.0
    assert not any(m.partial for m in cluster.match_batch([keyer.page_keys(prompt(0, 6))]))


def test_the_bench_replay_over_both_transports_matches_the_index_in_process(
    shards: dict[str, Any],
) -> None:
    """`replay_ops_on_cluster` (merged batches, rounds in flight) over Ray calls and over the
    direct channel leaves the shards answering as one in-process index fed the same stream."""
    prompts = [prompt(b % 9, 2 + b % 4, tail=b) for b in range(120)]
    stream = build_op_stream(prompts, capacity_pages=60, page_size=PAGE)
    assert any(isinstance(e, BlockRemoved) for r in stream.requests for e in r.events)
    want = PrefixIndex(PAGE)
    for r in stream.requests:
        want.apply(r.instance, r.events)
    queries = [r.page_keys for r in stream.requests[:60]]
    node = ray.get_runtime_context().get_node_id()
    instances = sorted({r.instance for r in stream.requests})
    for direct in (False, True):
        cluster = ClusterIndex(shards, page_size=PAGE, direct=direct, timeout_s=30, branch_depth=2)
        try:
            cluster.call_many({n: ("purge_instances", (instances,)) for n in cluster.names})
            got = replay_ops_on_cluster(
                cluster, stream, batch_requests=7, node_id=node, in_flight=2
            )
            assert got.timing.ops == stream.num_ops
            assert 0 < got.publish_cpu_s <= got.timing.cpu_seconds
            # (other tests' instances hold some of these prompts too: not compared)
            answers = [
                {i: n for i, n in m.lengths.items() if i in instances}
                for m in cluster.match_batch(queries)
            ]
            assert answers == [want.match_lengths(q) for q in queries]
            assert any(answers)
        finally:
            cluster.close()


def test_shard_restart_rebuilds_from_dumps(shards: dict[str, Any]) -> None:
    cluster = ClusterIndex(shards, page_size=PAGE)
    node = ray.get_runtime_context().get_node_id()
    inst = SimInstance("r", capacity_pages=500, page_size=PAGE)
    pub = ShardedPublisher("r", cluster, inst.tree, node_id=node)
    keyer = inst.tree.keyer
    assert keyer is not None
    for branch in range(100, 110):
        inst.serve(prompt(branch, 5))
        pub.publish(inst.take_events())
    keys = keyer.page_keys(prompt(100, 5))
    victim = cluster.owner(keys[0])
    assert cluster.match_batch([keys])[0].lengths.get("r") == 6  # 5 pages + the tail page
    ray.kill(shards[victim], no_restart=False)
    # ray.kill is asynchronous: wait until the restarted actor answers.
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(shards[victim].stats.remote(), timeout=5)["restarted"]:
                break
        except (ray.exceptions.RayError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "shard did not come back"
        time.sleep(0.2)
    # Restarted: it answers with what it has (nothing of r yet) and says it is rebuilding.
    answer = cluster.match_batch([keys])[0]
    assert answer.partial and "r" not in answer.lengths
    # r's next batch to that shard shows a gap (the shard expects seq 0): r sends a dump.
    dumps = pub.dumps_sent
    inst.serve(prompt(100, 5, tail=7))
    pub.publish(inst.take_events())
    assert pub.dumps_sent == dumps + 1
    assert cluster.match_batch([keys])[0].lengths.get("r") == 6
    deadline = time.monotonic() + 30  # the 5 s grace period, then complete again
    while cluster.match_batch([keys])[0].partial:
        assert time.monotonic() < deadline, "the shard never left its rebuilding state"
        time.sleep(0.2)


def test_each_shard_serves_its_metrics_on_loopback(shards: dict[str, Any]) -> None:
    import urllib.request

    cluster = ClusterIndex(shards, page_size=PAGE)
    before = cluster.stats()
    cluster.match_batch([[b"\x01" * 16], [b"\x02" * 16]])
    lookups = 0.0
    entries = 0.0
    for name, handle in shards.items():
        port = ray.get(handle.metrics_port.remote(), timeout=30)
        assert port is not None and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert values["kvstrata_prefix_index_entries"] == before[name]["entries"]
        assert "kvstrata_prefix_index_lookup_seconds_count" in values
        lookups += values["kvstrata_prefix_index_lookups_total"]
        entries += values["kvstrata_prefix_index_entries"]
    assert lookups >= 2  # the two queries above, on their owners (plus earlier tests' lookups)
    assert entries == sum(s["entries"] for s in before.values())


def test_a_dead_instance_actor_on_a_live_node_is_purged_within_2s(
    shards: dict[str, Any],
) -> None:
    cluster = ClusterIndex(shards, page_size=PAGE)
    node = ray.get_runtime_context().get_node_id()
    engine_cls = ray.remote(num_cpus=0)(Engine)
    engines = {n: engine_cls.remote() for n in ("dies", "lives")}  # type: ignore[attr-defined]
    assert ray.get([e.ping.remote() for e in engines.values()], timeout=120) == ["ok", "ok"]
    insts = {n: SimInstance(n, capacity_pages=200, page_size=PAGE) for n in engines}
    pubs = {
        n: ShardedPublisher(n, cluster, insts[n].tree, node_id=node, actor=engines[n])
        for n in engines
    }
    keyer = insts["dies"].tree.keyer
    assert keyer is not None
    queries = [keyer.page_keys(prompt(200 + b, 3)) for b in range(8)]
    for n, inst in insts.items():
        for b in range(8):
            inst.serve(prompt(200 + b, 3))
        pubs[n].publish(inst.take_events())
    before = cluster.match_batch(queries)
    assert all(m.lengths == {"dies": 4, "lives": 4} for m in before)
    ray.kill(engines["dies"])
    # Noticed: Ray reports the actor dead to a caller.
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(engines["dies"].ping.remote(), timeout=5)
        except ray.exceptions.ActorDiedError:
            break
        except (ray.exceptions.RayError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "Ray never reported the killed actor dead"
        time.sleep(0.05)
    noticed = time.monotonic()
    while any("dies" in m.lengths for m in cluster.match_batch(queries)):
        assert time.monotonic() - noticed < 10.0, "the dead instance was never purged"
        time.sleep(0.05)
    assert time.monotonic() - noticed <= 2.0
    assert all(m.lengths == {"lives": 4} for m in cluster.match_batch(queries))
    assert all("dies" in s["purged"] for s in cluster.stats().values())
    assert not any("lives" in s["purged"] for s in cluster.stats().values())


def test_direct_channel_routes_and_survives_a_shard_restart(shards: dict[str, Any]) -> None:
    cluster = ClusterIndex(shards, page_size=PAGE, direct=True, timeout_s=20)
    try:
        for name in cluster.names:
            assert cluster.channel(name).address.startswith("tcp://127.0.0.1:")
        node = ray.get_runtime_context().get_node_id()
        names = ["d1", "d2"]
        insts = {n: SimInstance(n, capacity_pages=300, page_size=PAGE) for n in names}
        pubs = {n: ShardedPublisher(n, cluster, insts[n].tree, node_id=node) for n in names}
        router = Router(cluster, names, policy="cache_aware", load_weight=0.1)
        keyer = insts["d1"].tree.keyer
        assert keyer is not None
        first: dict[int, str] = {}
        for branch in range(300, 308):
            toks = prompt(branch, 5)
            decision = router.route(keyer.page_keys(toks))
            insts[decision.instance].serve(toks)
            pubs[decision.instance].publish(insts[decision.instance].take_events())
            first[branch] = decision.instance
        for branch in range(300, 308):
            decision = router.route(keyer.page_keys(prompt(branch, 5, tail=1)))
            assert (decision.instance, decision.matched_pages) == (first[branch], 5)
        # The same answers as over Ray calls.
        queries = [keyer.page_keys(prompt(b, 5)) for b in range(300, 308)]
        over_ray = ClusterIndex(shards, page_size=PAGE).match_batch(queries)
        assert [m.lengths for m in cluster.match_batch(queries)] == [m.lengths for m in over_ray]

        keys = queries[0]
        holder = first[300]
        victim = cluster.owner(keys[0])
        old_address = cluster.channel(victim).address
        ray.kill(shards[victim], no_restart=False)
        # The channel of the killed process fails fast (a clear error, not a hang)...
        start = time.monotonic()
        with pytest.raises(ShardUnavailable):
            while time.monotonic() - start < 30:
                cluster.match_batch([keys])
                time.sleep(0.05)
        assert time.monotonic() - start < 15
        # ...and the next calls find the restarted actor's new channel through Ray.
        deadline = time.monotonic() + 60
        while True:
            try:
                answer = cluster.match_batch([keys])[0]
                break
            except ShardUnavailable:
                assert time.monotonic() < deadline, "no channel to the restarted shard"
                time.sleep(0.2)
        assert cluster.channel(victim).address != old_address
        assert answer.partial and holder not in answer.lengths
        # The holder's next batch to it is a gap: a dump (over the channel) rebuilds it.
        dumps = pubs[holder].dumps_sent
        insts[holder].serve(prompt(300, 5, tail=9))
        pubs[holder].publish(insts[holder].take_events())
        assert pubs[holder].dumps_sent == dumps + 1
        assert cluster.match_batch([keys])[0].lengths.get(holder) == 6  # 5 pages + the tail
    finally:
        cluster.close()
