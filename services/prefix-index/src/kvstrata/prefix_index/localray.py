"""A local Ray cluster on loopback for the shard tests and `kvstrata bench index --ray`
(RAY_NOTES.md: loopback and quiet settings in the environment before Ray starts, small object
stores, no dashboard, health checks fast enough to notice a killed node in ~1.5 s).

Set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before `import ray` anywhere in the process (Ray reads
it at import): that is what keeps every socket on 127.0.0.1. Set RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
there too: a driver started by `uv run` otherwise gets a runtime env that uploads the working
tree and starts every worker with `uv run` in a fresh copy of it (a new venv, no bytecode), so an
actor took over 60 s to start here and the cluster looked like it had not come up.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

from kvstrata.prefix_index.cluster import ClusterIndex, deploy_shards, replay_ops_on_cluster
from kvstrata.prefix_index.opstream import OpStream, OpTiming

_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # A loaded 2-core machine can take longer than the default 30 s to register a raylet.
    "RAY_raylet_start_wait_time_s": "120",
    "RAY_agent_register_timeout_ms": "120000",
}
_STORE = 128 * 1024 * 1024


class RayDidNotStart(RuntimeError):
    """The loopback cluster did not come up (an overloaded machine: Ray waits 30 s at most
    for a raylet to register, a constant in Ray 2.60)."""


def _start(num_workers: int) -> Cluster:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": _STORE,
            "include_dashboard": False,
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 3,
            },
        },
    )
    try:
        for i in range(num_workers):
            cluster.add_node(num_cpus=1, object_store_memory=_STORE, resources={f"w{i}": 1})
        cluster.wait_for_nodes()
    except Exception:
        cluster.shutdown()
        raise
    return cluster


@contextmanager
def loopback_cluster(num_workers: int, attempts: int = 2) -> Iterator[Cluster]:
    saved = {k: os.environ.get(k) for k in [*_ENV, "RAY_TMPDIR"]}
    tmp = tempfile.mkdtemp(prefix="kvstrata-prefix-index-ray-")
    os.environ.update(_ENV, RAY_TMPDIR=tmp)
    cluster: Cluster | None = None
    try:
        errors: list[str] = []
        for _ in range(attempts):
            try:
                cluster = _start(num_workers)
                break
            except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception on a timeout)
                errors.append(str(exc))
        if cluster is None:
            raise RayDidNotStart("; ".join(errors))
        ray.init(address=cluster.address, log_to_driver=False, namespace="kvstrata-test")
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def replay_on_local_cluster(
    stream: OpStream, *, batch_requests: int, num_workers: int = 1, branch_depth: int = 2
) -> tuple[OpTiming, int, float]:
    """Start a loopback cluster of 1 + `num_workers` nodes, deploy one shard per node, replay
    `stream` through them (`replay_ops_on_cluster`); returns the timing, the number of shards
    and the shard skew. Everything is shut down on return."""
    with loopback_cluster(num_workers=num_workers):
        shards = deploy_shards(stream.page_size)
        ray.get([h.stats.remote() for h in shards.values()], timeout=120)
        cluster = ClusterIndex(
            shards, page_size=stream.page_size, timeout_s=120, branch_depth=branch_depth
        )
        node = ray.get_runtime_context().get_node_id()
        timing = replay_ops_on_cluster(cluster, stream, batch_requests=batch_requests, node_id=node)
        return timing, len(shards), cluster.skew()
