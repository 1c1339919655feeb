"""A loopback Ray cluster for the shard tests (RAY_NOTES: env before Ray starts, small object
stores, no dashboard, fast health checks so a killed node is noticed in ~1.5 s)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
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
