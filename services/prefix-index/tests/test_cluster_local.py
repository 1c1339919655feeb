"""The sharded index with in-process shards (the same IndexShard the Ray actors run):
branch sharding, routing, lost batches and shard restarts rebuilt from dumps, node purges."""

from __future__ import annotations

import itertools

import pytest

from kvstrata.prefix_index import InvalidParameter, Router, SimInstance
from kvstrata.prefix_index.cluster import ClusterIndex, IndexShard, ShardedPublisher
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, decode_events

PAGE = 4


def prompt(branch: int, n_pages: int, tail: int = 0) -> list[int]:
    toks = [branch * 1000 + j for j in range(PAGE * n_pages)]
    return toks + [900_000 + tail * 10 + j for j in range(PAGE)]


def make(num_shards: int = 3) -> ClusterIndex:
    return ClusterIndex(
        {f"s{i}": IndexShard(PAGE, node_id=f"n{i}") for i in range(num_shards)}, page_size=PAGE
    )


def held_by(cluster: ClusterIndex, instance: str) -> set[bytes]:
    out: set[bytes] = set()
    for shard in cluster.shards.values():
        assert isinstance(shard, IndexShard)
        shard.index.check_integrity()
        out |= set(shard.index.holdings(instance))
    return out


def tree_keys(inst: SimInstance) -> set[bytes]:
    keys: set[bytes] = set()
    for node in inst.tree.iter_nodes():
        keys.update(inst.tree.page_keys(node))
    return keys


def test_branches_routing_and_shard_union() -> None:
    cluster = make()
    names = ["a", "b", "c"]
    insts = {n: SimInstance(n, capacity_pages=60, page_size=PAGE) for n in names}
    pubs = {n: ShardedPublisher(n, cluster, insts[n].tree, node_id="n0") for n in names}
    router = Router(cluster, names, policy="cache_aware", load_weight=0.1)
    keyer = insts["a"].tree.keyer
    assert keyer is not None
    first: dict[int, str] = {}
    for rnd in range(3):
        for branch in range(20):
            toks = prompt(branch, 3 + rnd, tail=rnd)
            d = router.route(keyer.page_keys(toks))
            if rnd == 0:
                first[branch] = d.instance
            insts[d.instance].serve(toks)
            pubs[d.instance].publish(insts[d.instance].take_events())
    for n in names:
        # The shards together hold exactly each tree's keys (evictions included).
        assert held_by(cluster, n) == tree_keys(insts[n])
    # A query is answered by one shard, the owner of its first key.
    keys = keyer.page_keys(prompt(5, 3))
    (answer,) = cluster.match_batch([keys])
    assert answer.shard == cluster.owner(keys[0]) and not answer.partial
    entries = [s["entries"] for s in cluster.stats().values()]
    assert all(e > 0 for e in entries)
    assert 1.0 <= cluster.skew() < 2.5


def test_second_request_goes_to_the_holder() -> None:
    cluster = make(2)
    names = ["x", "y"]
    insts = {n: SimInstance(n, capacity_pages=100, page_size=PAGE) for n in names}
    pubs = {n: ShardedPublisher(n, cluster, insts[n].tree, node_id="n0") for n in names}
    router = Router(cluster, names, policy="cache_aware", load_weight=0.1)
    keyer = insts["x"].tree.keyer
    assert keyer is not None
    d1 = router.route(keyer.page_keys(prompt(7, 8)))
    insts[d1.instance].serve(prompt(7, 8))
    pubs[d1.instance].publish(insts[d1.instance].take_events())
    d2 = router.route(keyer.page_keys(prompt(7, 8, tail=1)))
    assert d2.instance == d1.instance and d2.matched_pages == 8


def test_lost_batch_and_restarted_shard_are_rebuilt_from_dumps() -> None:
    cluster = make(2)
    inst = SimInstance("r", capacity_pages=200, page_size=PAGE)
    pub = ShardedPublisher("r", cluster, inst.tree, node_id="n0")
    for branch in range(12):
        inst.serve(prompt(branch, 4))
        pub.publish(inst.take_events())
    assert held_by(cluster, "r") == tree_keys(inst)
    # A lost batch: the shard sees a gap at the next one, drops r, and r sends a dump.
    keyer = inst.tree.keyer
    assert keyer is not None
    lost_shard = cluster.owner(keyer.page_keys(prompt(3, 4))[0])
    pub._seq[lost_shard] += 1  # the batch numbered here never arrives
    inst.serve(prompt(3, 5))
    pub.publish(inst.take_events())
    assert pub.dumps_sent == 1
    assert held_by(cluster, "r") == tree_keys(inst)
    # A shard restart: same name, empty state, rebuilding until r's dump arrives and the grace
    # period is over; meanwhile it answers with what it has, flagged partial.
    now = [0.0]
    cluster.shards[lost_shard] = IndexShard(
        PAGE, node_id="n0", restarted=True, rebuild_grace_s=1.0, clock=lambda: now[0]
    )
    keys = keyer.page_keys(prompt(3, 5))
    answer = cluster.match_batch([keys])[0]
    assert answer.partial and "r" not in answer.lengths
    inst.serve(prompt(3, 5, tail=2))
    pub.publish(inst.take_events())
    assert pub.dumps_sent == 2
    answer = cluster.match_batch([keys])[0]
    assert answer.lengths["r"] == 6 and answer.partial  # still in its grace period
    now[0] = 1.5
    assert not cluster.match_batch([keys])[0].partial
    assert held_by(cluster, "r") == tree_keys(inst)


def test_dead_node_instances_are_purged() -> None:
    cluster = make(2)
    a = SimInstance("on-n0", capacity_pages=50, page_size=PAGE)
    b = SimInstance("on-n1", capacity_pages=50, page_size=PAGE)
    pa = ShardedPublisher("on-n0", cluster, a.tree, node_id="n0")
    pb = ShardedPublisher("on-n1", cluster, b.tree, node_id="n1")
    for branch in range(6):
        a.serve(prompt(branch, 2))
        b.serve(prompt(branch, 2))
    pa.publish(a.take_events())
    pb.publish(b.take_events())
    purged = [
        shard.purge_dead({"n0"})
        for shard in cluster.shards.values()
        if isinstance(shard, IndexShard)
    ]
    assert ["on-n1"] in purged
    assert held_by(cluster, "on-n1") == set()
    assert held_by(cluster, "on-n0") == tree_keys(a)


def test_a_shared_first_page_needs_a_deeper_branch_key() -> None:
    # Every prompt opens with the same page (as every Mooncake request opens with block 0).
    def shared(branch: int) -> list[int]:
        return [7] * PAGE + [branch * 1000 + j for j in range(PAGE * 3)]

    skews = {}
    for depth in (1, 2):
        cluster = ClusterIndex(
            {f"s{i}": IndexShard(PAGE, node_id="n0") for i in range(3)},
            page_size=PAGE,
            branch_depth=depth,
        )
        inst = SimInstance("i", capacity_pages=500, page_size=PAGE)
        pub = ShardedPublisher("i", cluster, inst.tree, node_id="n0")
        for branch in range(30):
            inst.serve(shared(branch))
            pub.publish(inst.take_events())
        assert held_by(cluster, "i") == tree_keys(inst)
        keyer = inst.tree.keyer
        assert keyer is not None
        for branch in range(30):
            assert cluster.match_lengths(keyer.page_keys(shared(branch))) == {"i": 4}
        # The trunk page alone is answered too (by the owner of page 0).
        assert cluster.match_lengths(keyer.page_keys([7] * PAGE)) == {"i": 1}
        skews[depth] = cluster.skew()
        # A restarted shard notices at the next batch it gets, and its dump brings the trunk.
        name = max(cluster.stats().items(), key=lambda kv: kv[1]["entries"])[0]
        cluster.shards[name] = IndexShard(PAGE, node_id="n0", restarted=True)
        dumps = pub.dumps_sent
        branch = 31
        while pub.dumps_sent == dumps:
            assert branch < 100, "no batch ever reached the restarted shard"
            inst.serve(shared(branch))
            pub.publish(inst.take_events())
            branch += 1
        assert held_by(cluster, "i") == tree_keys(inst)
    assert skews[1] == 3.0  # one shard holds everything
    assert skews[2] < 1.6


def test_an_instance_whose_lease_runs_out_is_purged_and_publishes_renew_it() -> None:
    now = [0.0]
    shards = {f"s{i}": IndexShard(PAGE, node_id="n0", clock=lambda: now[0]) for i in range(2)}
    cluster = ClusterIndex(shards, page_size=PAGE)
    quiet, busy, plain = (SimInstance(n, capacity_pages=100, page_size=PAGE) for n in "qbp")
    clock = lambda: now[0]  # noqa: E731
    pq = ShardedPublisher("q", cluster, quiet.tree, node_id="n0", ttl_s=1.0, clock=clock)
    pb = ShardedPublisher("b", cluster, busy.tree, node_id="n0", ttl_s=1.0, clock=clock)
    pp = ShardedPublisher("p", cluster, plain.tree, node_id="n0")  # no lease: never expires
    for inst, pub in ((quiet, pq), (busy, pb), (plain, pp)):
        inst.serve(prompt(1, 3))
        pub.publish(inst.take_events())
    # 2.5 s in 0.5 s steps: b publishes (its branches are on one shard: the other gets renews),
    # q only heartbeats once.
    for step in range(1, 6):
        now[0] = step * 0.5
        busy.serve(prompt(step, 2))
        pb.publish(busy.take_events())
        if step == 1:
            pq.heartbeat()
        for shard in shards.values():
            shard.purge_expired()
        expired = now[0] > 0.5 + 1.0
        assert (held_by(cluster, "q") == set()) == expired, now[0]
    assert held_by(cluster, "b") == tree_keys(busy)
    assert held_by(cluster, "p") == tree_keys(plain)
    assert all(s.purged == ["q"] for s in shards.values())
    # A purged instance that comes back registers again and is indexed again.
    # Its next batch shows a gap on the shard that purged it: a dump (and a registration).
    quiet.serve(prompt(9, 2))
    pq.publish(quiet.take_events())
    assert pq.dumps_sent >= 1
    assert held_by(cluster, "q") == tree_keys(quiet)


def test_lease_must_be_positive() -> None:
    cluster = make(1)
    shard = cluster.shards["s0"]
    assert isinstance(shard, IndexShard)
    for bad in (0.0, -1.0):
        with pytest.raises(InvalidParameter, match="ttl_s"):
            ShardedPublisher("x", cluster, None, node_id="n0", ttl_s=bad)
        with pytest.raises(InvalidParameter, match="ttl_s"):
            shard.register("x", "n0", ttl_s=bad)
    assert shard.stats()["instances"] == 0 and shard.purge_expired() == []


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_evictions_of_trunk_and_branch_keys_keep_the_shards_equal_to_the_tree(depth: int) -> None:
    # Small instance, prompts with a few shared openings: evictions remove trunk keys (depth <
    # d - 1, on every shard) as well as branch keys, in batches that mix both.
    cluster = ClusterIndex(
        {f"s{i}": IndexShard(PAGE, node_id="n0") for i in range(3)},
        page_size=PAGE,
        branch_depth=depth,
    )
    inst = SimInstance("i", capacity_pages=24, page_size=PAGE)
    pub = ShardedPublisher("i", cluster, inst.tree, node_id="n0")
    for r in range(60):
        opening = [r % 4] * PAGE + [100 + r % 3] * PAGE
        inst.serve(opening + [r * 1000 + j for j in range(PAGE * (1 + r % 4))])
        pub.publish(inst.take_events())
        assert held_by(cluster, "i") == tree_keys(inst)
        for shard in cluster.shards.values():
            assert isinstance(shard, IndexShard)
            assert not shard.index.needs_dump("i")
    assert pub.dumps_sent == 0
    assert not pub._branch.keys() & pub._trunk.keys()  # pyright: ignore[reportPrivateUsage]
    assert set(pub._branch) | set(pub._trunk) == tree_keys(inst)  # pyright: ignore[reportPrivateUsage]


def test_direct_channels_need_ray_shard_actors() -> None:
    with pytest.raises(InvalidParameter, match="direct"):
        ClusterIndex({"s0": IndexShard(PAGE)}, page_size=PAGE, direct=True)


def test_a_batch_merges_consecutive_parts_of_one_kind() -> None:
    """A shard's batch carries one event per run of parts of one kind and tier (not one per
    part), and the shards still hold exactly the tree's keys after each batch."""
    cluster = make(2)
    big = SimInstance("big", capacity_pages=10_000, page_size=PAGE)
    pub = ShardedPublisher("big", cluster, big.tree, node_id="n0")
    for branch in range(12):  # 12 stores, no evictions: one BlockStored per shard
        big.serve(prompt(branch, 3))
    events = big.take_events()
    assert len(events) == 12
    batches = pub.batches(events)
    assert len(batches) == 2
    for name, (instance, seq, payload) in batches.items():
        (got,) = decode_events(payload)
        assert isinstance(got, BlockStored)
        shard = cluster.shards[name]
        assert isinstance(shard, IndexShard)
        assert shard.apply_batches([(instance, seq, payload)]) == [True]
    assert held_by(cluster, "big") == tree_keys(big)

    small = SimInstance("small", capacity_pages=30, page_size=PAGE)
    pub = ShardedPublisher("small", cluster, small.tree, node_id="n0")
    for rnd in range(6):  # stores and evictions interleaved
        for branch in range(12):
            small.serve(prompt(branch, 2 + rnd, tail=rnd))
        events = small.take_events()
        assert any(isinstance(e, BlockRemoved) for e in events)
        for name, (instance, seq, payload) in pub.batches(events).items():
            got = decode_events(payload)
            assert len(got) < len(events)
            for a, b in itertools.pairwise(got):
                assert (type(a), getattr(a, "tier", None)) != (type(b), getattr(b, "tier", None))
            shard = cluster.shards[name]
            assert isinstance(shard, IndexShard)
            assert shard.apply_batches([(instance, seq, payload)]) == [True]
        assert held_by(cluster, "small") == tree_keys(small)
