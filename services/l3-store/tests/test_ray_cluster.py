"""Three nodes on loopback (one module-scoped cluster): stores up on every node, two engines on
different nodes share a prefix through ray://, the same-node path goes through the arena."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray import cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.l3_store import deploy
from kvstrata.l3_store.actor import StoreConfig
from kvstrata.l3_store.client import RayStorage
from kvstrata.l3_store.core import StoreParams
from kvstrata.l3_store.routing import home
from kvstrata.storage import open_storage
from kvstrata.storage.errors import BufferSizeMismatch, InvalidStorageURL

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines run this module's code

NS = "l3-cluster-test"
PAGE = 4  # tokens per page


def _config(arena_dir: str) -> StoreConfig:
    return StoreConfig(namespace=NS, params=StoreParams(memory_bytes=16 << 20), arena_dir=arena_dir)


@pytest.fixture(scope="module")
def stores(ray_cluster: Any) -> Any:
    done = deploy.up(_config(ray_cluster.arena_dir), reconcile_s=60.0)
    assert sorted(done.created) == deploy.alive_nodes() and not done.failed
    return ray_cluster


def _serve(storage_url: str, tokens: list[int], seed: int) -> dict[str, int]:
    """One engine: a HierarchicalCache whose storage is `storage_url` serves one request and
    checks the KV of its hit bit for bit; returns where the hit came from. The only place that
    knows the tiered cache's API."""
    import torch

    from kvstrata.testkit.tiers import assert_prefix_kv, make_hierarchy, write_prefix_kv
    from kvstrata.unified_radix_cache import RadixKey
    from kvstrata.unified_radix_cache.tiers import PrefetchPolicy, TierParams

    storage = open_storage(storage_url)
    params = TierParams(prefetch_threshold=PAGE, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    h = make_hierarchy(page_size=PAGE, storage=storage, params=params, seed=seed)
    try:
        cache = h.cache
        ids = torch.tensor(tokens, dtype=torch.int64)
        req = cache.begin_request(RadixKey(ids))
        hit = req.cached_len
        assert_prefix_kv(h.device_pool, cache.keyer, ids, req.kv_indices[:hit], what="hit")
        slots = h.allocator.alloc(len(tokens) - hit)
        assert slots is not None
        write_prefix_kv(h.device_pool, cache.keyer, ids, torch.cat([req.kv_indices, slots]), hit)
        req.extend(slots)
        cache.cache_finished_request(req)
        cache.drain()
        cache.check_integrity()
        return {"hit": hit, "storage_hit": req.hit.storage_len}
    finally:
        h.cache.controller.close()


@ray.remote(num_cpus=0)
class Engine:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def serve(self, url: str, tokens: list[int], seed: int) -> dict[str, int]:
        return _serve(url, tokens, seed)


def _engine(node_id: str) -> Any:
    return Engine.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote()


def test_every_node_has_one_pinned_store(stores: Any) -> None:
    rows = deploy.status(NS)
    assert [r.node_id for r in rows] == deploy.alive_nodes() and len(rows) == 3
    assert all(r.stats is not None and r.stats.memory_pages == 0 for r in rows)
    for node_id in deploy.alive_nodes():
        info = ray.get(ray.get_actor(deploy.store_name(node_id), namespace=NS).info.remote())
        assert info.node_id == node_id
        assert Path(info.arena_path).stat().st_size == 16 << 20
    again = deploy.up(_config(stores.arena_dir), reconcile_s=60.0)
    assert again.created == [] and again.failed == [], "up is idempotent"


def test_second_engine_on_another_node_hits_the_first_ones_prefix(stores: Any) -> None:
    url = f"ray://?namespace={NS}&timeout_ms=5000"
    nodes = deploy.alive_nodes()
    first, second = _engine(nodes[1]), _engine(nodes[2])
    assert ray.get([first.node.remote(), second.node.remote()]) == nodes[1:]
    tokens = list(range(1, 8 * PAGE + 1))
    cold = ray.get(first.serve.remote(url, tokens, 1), timeout=60)
    assert cold == {"hit": 0, "storage_hit": 0}
    warm = ray.get(second.serve.remote(url, tokens, 2), timeout=60)
    # begin_request matches at most len - 1 tokens, page-aligned: the first 7 of 8 pages.
    assert warm == {"hit": 7 * PAGE, "storage_hit": 7 * PAGE}, warm
    pages = sum(r.stats.memory_pages for r in deploy.status(NS) if r.stats is not None)
    assert pages >= 8


def test_driver_reads_local_pages_through_the_arena(stores: Any) -> None:
    storage = RayStorage(namespace=NS, timeout_s=5.0)
    try:
        nodes = sorted(storage.stores())
        assert len(nodes) == 3 and storage.node_id in nodes
        rng = np.random.default_rng(0)
        keys = [b"driver-%d" % i for i in range(40)]
        pages = [rng.integers(0, 256, 10_000 + i, dtype=np.uint8) for i in range(40)]
        assert storage.batch_set(keys, pages) == [True] * 40
        assert storage.batch_set(keys[:3], pages[:3]) == [True] * 3  # present: kept
        outs = [np.zeros_like(p) for p in pages]
        assert storage.batch_get(keys, outs) == [True] * 40
        assert all(np.array_equal(o, p) for o, p in zip(outs, pages, strict=True))
        local = [k for k in keys if home(k, nodes) == storage.node_id]
        counters = storage.counters()
        assert local and len(local) < 40
        assert counters.local_pages >= 2 * len(local)  # written and read through the arena
        assert counters.remote_pages >= 2 * (40 - len(local))
        assert storage.batch_exists(keys) == 40
        assert storage.batch_exists([*keys[:5], b"absent", *keys[5:]]) == 5
        wrong = [np.zeros(3, dtype=np.uint8) for _ in keys]
        with pytest.raises(BufferSizeMismatch):
            storage.batch_get(keys, wrong)
        assert all(not w.any() for w in wrong), "no buffer written before the size check"
        assert storage.delete(keys[:10]) == 10
        assert storage.batch_get(keys[:10], outs[:10]) == [False] * 10
        storage.check_integrity()
    finally:
        storage.close()


def test_a_flipped_byte_in_an_arena_is_a_counted_miss(stores: Any) -> None:
    """Same-node (through the mapping) and cross-node (through `read`): a page whose arena
    bytes changed after it was stored is a miss and counted corrupt, never returned."""
    storage = RayStorage(namespace=NS, timeout_s=5.0)
    try:
        nodes = sorted(storage.stores())
        far = next(n for n in nodes if n != storage.node_id)
        keys = [b"flip-near-%d" % i for i in range(200)]
        near = next(k for k in keys if home(k, nodes) == storage.node_id)
        away = next(k for k in keys if home(k, nodes) == far)
        page = np.arange(300_000, dtype=np.uint32).view(np.uint8)
        assert storage.batch_set([near, away], [page, page]) == [True, True]
        for key, node in ((near, storage.node_id), (away, far)):
            store = storage.stores()[node]
            grant = ray.get(store.handle.lease.remote([key]))
            ray.get(store.handle.release.remote(grant.lease_id))
            [ref] = grant.refs
            fd = os.open(store.info.arena_path, os.O_RDWR)
            try:
                at = ref.offset + ref.size // 2
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
            finally:
                os.close(fd)
        before = storage.stats().corrupt_pages
        outs = [np.zeros_like(page), np.zeros_like(page)]
        assert storage.batch_get([near, away], outs) == [False, False]
        assert storage.stats().corrupt_pages == before + 2
    finally:
        storage.close()


def test_ray_url_through_the_entry_point(stores: Any) -> None:
    storage = open_storage(f"ray://?namespace={NS}&timeout_ms=700&refresh_ms=100")
    assert isinstance(storage, RayStorage) and storage.timeout_s == 0.7
    with pytest.raises(InvalidStorageURL):
        open_storage("ray://?namespace=x&timeout=5")  # a typo names the parameters it takes
    with pytest.raises(InvalidStorageURL):
        open_storage("ray://?timeout_ms=0")


def test_store_metrics_endpoint_on_loopback(stores: Any) -> None:
    import urllib.request

    node_id = ray.get_runtime_context().get_node_id()
    info = ray.get(ray.get_actor(deploy.store_name(node_id), namespace=NS).info.remote())
    assert info.metrics_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{info.metrics_port}/metrics") as resp:
        text = resp.read().decode()
    assert 'kvstrata_l3_store_capacity_bytes{medium="memory"} 1.6777216e+07' in text
    assert "kvstrata_l3_store_written_pages_total" in text
    assert "node=" not in text  # the scrape adds the node, never the collector
