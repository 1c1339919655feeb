"""`kvstrata replay --instances 2 --ray` on a loopback Ray cluster (one per module): the same
routing and hits, instance by instance, as the in-process run of the same requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from kvstrata.l3_store import deploy
from kvstrata.prefix_index.cluster import NAME_PREFIX
from kvstrata.replay import WorkloadSpec, generate_workload
from kvstrata.replay.cluster import ClusterReport, ClusterSpec, run_cluster
from kvstrata.replay_ray import RayCluster, local_ray
from kvstrata.replay_ray.errors import InvalidRayOption, RayDidNotStart
from kvstrata.storage import MemoryStorage

NAMESPACE = "kvstrata-replay-test"
L3_BYTES = 64 << 20  # never full for these few requests: both L3s hold every page


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    try:
        with local_ray(namespace="kvstrata-replay-test-driver") as addr:
            yield addr
    except RayDidNotStart as exc:  # a failure, not a skip: a skip would hide every test here
        pytest.fail(f"Ray could not start a loopback cluster on this machine: {exc}")


def _spec(router: str, **kw: object) -> ClusterSpec:
    # The embedded workload's prompts reach 101 pages of 16 tokens: 120-page devices evict,
    # write-back sends what they evict to the host (half the device) and on to the L3.
    return ClusterSpec(
        num_instances=2,
        capacity_pages=120,
        router=router,
        load_weight=0.1,
        prefetch_threshold=16,
        **kw,  # type: ignore[arg-type]
    )


def _figures(report: ClusterReport) -> list[tuple[int, int, int, int, int, int]]:
    return [
        (i.requests, i.pages, i.device_hits, i.host_hits, i.l3_hits, report.pooled_hits)
        for i in report.instances
    ]


def _named_left() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(NAME_PREFIX) or a["namespace"] == NAMESPACE
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_run_equals_in_process_run_with_a_shared_l3(address: str) -> None:
    requests = generate_workload(WorkloadSpec(seed=0))[:60]
    spec = _spec("cache-aware", host_ratio=0.5, write_policy="write_back")
    local = run_cluster(spec, requests, l3=MemoryStorage(capacity_bytes=L3_BYTES))
    cluster = RayCluster(
        spec,
        address=address,
        storage_url=f"ray://?namespace={NAMESPACE}&timeout_ms=30000",
        l3_bytes=L3_BYTES,
    )
    try:
        on_ray = run_cluster(spec, requests, backend=cluster)
        cluster.check_integrity()
    finally:
        cluster.close()
    assert on_ray.backend == "RayCluster" and local.backend == "LocalCluster"
    assert [row[1] for row in on_ray.timeline] == [row[1] for row in local.timeline]
    assert _figures(on_ray) == _figures(local)
    assert on_ray.hit_rate == local.hit_rate
    # The run used the services for real: hits came from the host tiers and the L3 stores.
    assert sum(i.l3_hits for i in on_ray.instances) > 0
    assert sum(i.host_hits for i in on_ray.instances) > 0
    assert on_ray.l3_capacity_pages > 0
    # ... and took down the stores and shards it brought up.
    assert _named_left() == []
    assert [s for s in deploy.status(NAMESPACE) if s.stats is not None] == []


def test_options_are_checked_before_ray_is_touched() -> None:
    spec = _spec("round-robin")
    with pytest.raises(InvalidRayOption, match="ray:// storage"):
        RayCluster(spec, address="127.0.0.1:1", storage_url="memory://")
    with pytest.raises(InvalidRayOption, match="> 0"):
        RayCluster(spec, address="127.0.0.1:1", storage_url="ray://", l3_bytes=0)
    with pytest.raises(InvalidRayOption, match="without ray://"):
        RayCluster(spec, address="127.0.0.1:1", l3_bytes=10)
    with pytest.raises(InvalidRayOption, match="timeout_s"):
        RayCluster(spec, address="127.0.0.1:1", timeout_s=0)


def test_an_l3_that_is_not_up_needs_its_size(address: str) -> None:
    with pytest.raises(InvalidRayOption, match="--l3-bytes"):
        RayCluster(
            _spec("round-robin"), address=address, storage_url=f"ray://?namespace={NAMESPACE}"
        )
    assert _named_left() == []
