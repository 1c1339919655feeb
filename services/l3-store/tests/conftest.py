"""Ray clusters for this package's tests: loopback only, quiet, small, always shut down.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (set before Ray starts) binds every Ray socket to
127.0.0.1 (RAY_NOTES); health checks are tuned so a dead node is noticed within ~2 s."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

for _name, _value in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    # Under `uv run`, Ray would otherwise package the whole worktree as every job's working_dir:
    # the workers run this same venv already.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # On a loaded 2-core machine a node's agents can take longer than Ray's 30 s defaults to
    # start; a slow start is not a failure here.
    "RAY_agent_register_timeout_ms": "120000",
    "RAY_raylet_start_wait_time_s": "120",
}.items():
    os.environ.setdefault(_name, _value)
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="kvstrata-l3-ray-"))

OBJECT_STORE_BYTES = 128 << 20
HEALTH = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@dataclass
class RayCluster:
    cluster: object  # ray.cluster_utils.Cluster
    workers: list[object]  # the worker nodes, in the order added
    arena_dir: str  # a private directory under /dev/shm for the stores' arena files


def start_cluster(num_workers: int) -> RayCluster:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "_system_config": HEALTH,
        },
    )
    try:
        workers = [
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
            for _ in range(num_workers)
        ]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="kvstrata-tests")
    except BaseException:
        cluster.shutdown()  # never leave a half-started cluster running
        raise
    arena_dir = tempfile.mkdtemp(prefix="kvstrata-l3-test-", dir="/dev/shm")
    return RayCluster(cluster, workers, arena_dir)


def stop_cluster(rc: RayCluster) -> None:
    import shutil

    import ray

    ray.shutdown()
    rc.cluster.shutdown()  # pyright: ignore[reportAttributeAccessIssue]
    shutil.rmtree(rc.arena_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A head and two workers (3 nodes), one per test module."""
    rc = start_cluster(2)
    try:
        yield rc
    finally:
        stop_cluster(rc)
