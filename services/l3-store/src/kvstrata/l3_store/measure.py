"""The Ray figures of `kvstrata bench l3 --ray` (here because only services import Ray).

A loopback cluster of two nodes (head + one worker, `ray.cluster_utils.Cluster`), stores up on
both, the driver on the head. Each figure beside its baseline, measured alternately:

- same-node get / put of `num_pages` pages through the arena, against a plain memcpy of the
  same bytes into / out of the same buffers (target >= 0.8);
- cross-node get / put (pages whose home is the worker), against a raw `ray.get` of the same
  numpy arrays held by (get) or sent to (put) an actor on the worker (target >= 0.7);
- p99 latency of a 1-page get, same node and cross node.

Beside the same-node figures, what bounds them, measured in the same rounds: `copy_checksum`
of the same pages without any call (what a verified copy costs: the ceiling of the
same-node ratio with free calls is memcpy / this) and one empty actor round trip (`info`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.l3_store import deploy
from kvstrata.l3_store.actor import StoreConfig
from kvstrata.l3_store.client import RayStorage
from kvstrata.l3_store.core import StoreParams, copy_checksum
from kvstrata.l3_store.loopback import loopback_ray
from kvstrata.l3_store.routing import home

NAMESPACE = "kvstrata-bench"


class _Holder:
    """The raw-Ray baseline: arrays kept by (or sent to) an actor on the worker."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    @ray.method  # types `.remote` on the actor handle
    def hold(self, arrays: list[np.ndarray]) -> int:
        self.arrays = [np.array(a, copy=True) for a in arrays]
        return len(self.arrays)

    @ray.method
    def give(self) -> list[np.ndarray]:
        return self.arrays


def _alternate(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in samples.items()}


def _keys_homed(nodes: list[str], node: str, n: int, tag: bytes) -> list[bytes]:
    keys: list[bytes] = []
    i = 0
    while len(keys) < n:
        key = b"%s-%d" % (tag, i)
        if home(key, nodes) == node:
            keys.append(key)
        i += 1
    return keys


def _p99(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 99))


@loopback_ray()
def run(*, page_bytes: int, num_pages: int, repeats: int) -> list[dict[str, Any]]:
    """Start the cluster (on 127.0.0.1 whenever Ray was imported), measure, shut it down; one
    dict per figure."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # workers share this venv
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="kvstrata-bench-ray-"))
    # Room for every round's puts (no eviction inside a timed call) and the pages read.
    store_bytes = (repeats + 4) * num_pages * page_bytes + (64 << 20)
    object_store = max(256 << 20, 4 * num_pages * page_bytes)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": object_store,
                        "include_dashboard": False},
    )  # fmt: skip
    arena_dir = tempfile.mkdtemp(prefix="kvstrata-bench-", dir="/dev/shm")
    try:
        cluster.add_node(num_cpus=1, object_store_memory=object_store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        config = StoreConfig(
            namespace=NAMESPACE, params=StoreParams(memory_bytes=store_bytes), arena_dir=arena_dir
        )
        deploy.up(config, reconcile_s=60.0)
        return _measure(page_bytes, num_pages, repeats)
    finally:
        if ray.is_initialized():
            deploy.down(NAMESPACE, arena_dir=arena_dir)
            ray.shutdown()
        cluster.shutdown()
        os.rmdir(arena_dir) if not os.listdir(arena_dir) else None


def _measure(page_bytes: int, num_pages: int, repeats: int) -> list[dict[str, Any]]:
    storage = RayStorage(namespace=NAMESPACE, timeout_s=30.0, refresh_s=3600.0)
    nodes = sorted(storage.stores())
    local = storage.node_id
    remote = next(n for n in nodes if n != local)
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    outs = [np.empty(page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    near = _keys_homed(nodes, local, num_pages, b"near")
    far = _keys_homed(nodes, remote, num_pages, b"far")
    assert all(storage.batch_set(near, pages)) and all(storage.batch_set(far, pages))
    holder = (
        ray.remote(_Holder)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(remote, False))
        .remote()
    )
    ray.get(holder.hold.remote(pages))
    store = storage.stores()[local]
    if store.arena is not None:  # timed copies run on a populated mapping, as in steady state
        store.arena.populated.wait(120)
    # New keys for every round (a stored key is skipped), homed and made before timing.
    fresh = {
        which: iter(
            [_keys_homed(nodes, node, num_pages, b"%s-put-%d" % (which.encode(), r))
             for r in range(repeats + 1)]
        )
        for which, node in (("near", local), ("far", remote))
    }  # fmt: skip

    def memcpy_out() -> None:
        for o, p in zip(outs, pages, strict=True):
            np.copyto(o, p)

    def copy_checked() -> None:
        for o, p in zip(outs, pages, strict=True):
            copy_checksum(o.data, p.data)

    def put_fresh(which: str) -> None:
        assert all(storage.batch_set(next(fresh[which]), pages))

    t = _alternate(
        {
            "near_get": lambda: storage.batch_get(near, outs),
            "memcpy": memcpy_out,
            "copy_checksum": copy_checked,
            "round_trip": lambda: ray.get(store.handle.info.remote()),
            "near_put": lambda: put_fresh("near"),
            "far_get": lambda: storage.batch_get(far, outs),
            "ray_get": lambda: ray.get(holder.give.remote()),
            "far_put": lambda: put_fresh("far"),
            "ray_put": lambda: ray.get(holder.hold.remote(pages)),
        },
        repeats,
    )
    assert storage.batch_get(far, outs) == [True] * num_pages
    assert all(np.array_equal(o, p) for o, p in zip(outs, pages, strict=True))
    total = num_pages * page_bytes
    lines: list[dict[str, Any]] = []
    bounds = {
        "copy_checksum_gb_per_s": round(total / t["copy_checksum"] / 1e9, 3),
        "ratio_if_calls_were_free": round(t["memcpy"] / t["copy_checksum"], 3),
        "actor_round_trip_ms": round(t["round_trip"] * 1e3, 3),
    }
    for op, ours, base, baseline, target in (
        ("get same-node", "near_get", "memcpy", "memcpy of the same bytes", 0.8),
        ("put same-node", "near_put", "memcpy", "memcpy of the same bytes", 0.8),
        ("get cross-node", "far_get", "ray_get", "raw ray.get of the same numpy arrays", 0.7),
        ("put cross-node", "far_put", "ray_put", "raw ray.get of an actor call taking them", 0.7),
    ):
        ours_gbps, base_gbps = total / t[ours] / 1e9, total / t[base] / 1e9
        lines.append(
            {
                "bench": "l3", "backend": "ray", "op": op, "page_bytes": page_bytes,
                "pages": num_pages, "gb_per_s": round(ours_gbps, 3), "baseline": baseline,
                "baseline_gb_per_s": round(base_gbps, 3),
                "ratio": round(ours_gbps / base_gbps, 3), "target_ratio": target,
                **(bounds if op.endswith("same-node") else {}),
            }
        )  # fmt: skip
    one = [np.empty(page_bytes, dtype=np.uint8)]
    for where, key in (("same-node", near[0]), ("cross-node", far[0])):
        p99 = _p99(lambda k=key: storage.batch_get([k], one), 100)
        lines.append(
            {"bench": "l3", "backend": "ray", "op": f"get 1 page p99 {where}",
             "page_bytes": page_bytes, "p99_ms": round(p99 * 1e3, 3)}
        )  # fmt: skip
    lines.append({"bench": "l3", "backend": "ray", "client": storage.counters().__dict__})
    storage.close()
    return lines
