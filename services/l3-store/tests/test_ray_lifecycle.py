"""Destructive lifecycle on its own 3-node cluster: an engine that starts before `up` gets
misses and dropped writes, never errors; killing a store gives misses; `up` restores it; the
supervisor recreates a store on its own; `down` leaves no actor and no arena file behind."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray

from kvstrata.l3_store import deploy
from kvstrata.l3_store.actor import StoreConfig
from kvstrata.l3_store.client import RayStorage
from kvstrata.l3_store.core import StoreParams
from kvstrata.l3_store.routing import home

NS = "l3-lifecycle-test"


def _pages(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [b"life-%d-%d" % (seed, i) for i in range(n)]
    return keys, [rng.integers(0, 256, 5000, dtype=np.uint8) for _ in range(n)]


def _wait(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _dead(actor: Any) -> bool:
    """Whether Ray reports `actor` dead (its next call fails instead of answering)."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=2.0)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False
    return False


def test_misses_before_up_kill_restore_and_down(ray_cluster: Any) -> None:
    storage = RayStorage(namespace=NS, timeout_s=3.0, refresh_s=0.2)
    keys, pages = _pages(30, 0)
    outs = [np.zeros_like(p) for p in pages]
    # Before `up`: no store anywhere. Misses and dropped writes, no exception.
    assert storage.batch_set(keys, pages) == [False] * 30
    assert storage.batch_get(keys, outs) == [False] * 30
    assert storage.batch_exists(keys) == 0
    assert storage.counters().dropped_writes == 30

    config = StoreConfig(
        namespace=NS, params=StoreParams(memory_bytes=8 << 20), arena_dir=ray_cluster.arena_dir
    )
    deploy.up(config, reconcile_s=1.0)
    storage.refresh()
    assert len(storage.stores()) == 3
    assert storage.batch_set(keys, pages) == [True] * 30

    # Kill the store that is home to some of the pages (not the driver's node).
    nodes = deploy.alive_nodes()
    victim = next(n for n in nodes if n != storage.node_id)
    lost = [i for i, k in enumerate(keys) if home(k, nodes) == victim]
    assert lost, "rendezvous hashing gave the victim no page"
    victim_store = ray.get_actor(deploy.store_name(victim), namespace=NS)
    ray.kill(victim_store)
    _wait(lambda: _dead(victim_store))  # ray.kill returns before the actor is gone
    got = storage.batch_get(keys, outs)  # the dead store is a miss, the rest still hit
    assert [i for i, ok in enumerate(got) if not ok] == lost
    assert all(np.array_equal(outs[i], pages[i]) for i, ok in enumerate(got) if ok)

    # The supervisor (reconciling every second) brings the store back, empty.
    _wait(lambda: all(r.stats is not None for r in deploy.status(NS, timeout_s=1.0)))
    again = deploy.up(config, reconcile_s=1.0)
    assert again.created == [] and again.failed == []
    storage.refresh()
    assert storage.batch_set(keys, pages) == [True] * 30
    assert storage.batch_get(keys, outs) == [True] * 30

    # A node that leaves takes its store with it; the rest keep serving.
    ray_cluster.cluster.remove_node(ray_cluster.workers[-1])
    _wait(lambda: len(deploy.alive_nodes()) == 2)
    storage.refresh()
    assert len(storage.stores()) == 2
    keys2, pages2 = _pages(10, 1)
    assert storage.batch_set(keys2, pages2) == [True] * 10

    # down: no store, no supervisor, no arena file.
    assert deploy.down(NS, arena_dir=ray_cluster.arena_dir) == 2
    assert all(r.stats is None for r in deploy.status(NS, timeout_s=1.0))
    names = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in names if a["namespace"] == NS], names
    assert os.listdir(ray_cluster.arena_dir) == []
    storage.refresh()
    assert storage.batch_get(keys2, [np.zeros_like(p) for p in pages2]) == [False] * 10
    storage.close()
