"""`RayCluster`: the `ClusterBackend` of `kvstrata replay --instances N --ray`.

    driver (this process)                          Ray cluster
      run_cluster: arrivals, Router  ----------->  InstanceActor x N   EngineInstance
        router.index = ClusterIndex  --match-->      |  serve(request): engine step,
                                                      |  publish events --> IndexShard actors
        pooled ideal (in process)                     |  L3: open_storage("ray://...")
                                                      +--------------->  L3 store actors

Start-up (`RayCluster.__init__`): join the cluster at `address` or start a loopback one
(`local_ray`); bring up the L3 stores (`kvstrata.l3_store.deploy.up`, the logic of
`kvstrata services up`) when an L3 is asked, and the prefix index shards
(`kvstrata.prefix_index.cluster.deploy_shards`); then one actor per instance. `close()` stops
the actors, takes down the stores and shards this run created (all of them on a loopback
cluster) and shuts the loopback cluster down.

The driver serves one request at a time and waits for its answer (which includes the
instance's events reaching the shards) before routing the next, so a run routes exactly as the
in-process `LocalCluster` does for the same arrival order. Every Ray call has a timeout;
a dead actor or a call that times out is an `InstanceFailed`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayError

from kvstrata.l3_store import deploy
from kvstrata.l3_store.actor import StoreConfig
from kvstrata.l3_store.core import StoreParams
from kvstrata.l3_store.loopback import loopback_ray
from kvstrata.prefix_index.cluster import (
    NAME_PREFIX,
    NAMESPACE,
    ClusterIndex,
    deploy_shards,
    remove_shards,
)
from kvstrata.replay.cluster import ClusterSpec
from kvstrata.replay.cluster_instance import Served
from kvstrata.replay.request import ReplayRequest
from kvstrata.replay_ray.actor import InstanceActor
from kvstrata.replay_ray.errors import InstanceFailed, InvalidRayOption, RayDidNotStart
from kvstrata.storage.registry import parse_storage_url

#: Object store of a loopback cluster (RAY_NOTES.md: 128-512 MiB; the replay moves little).
LOCAL_OBJECT_STORE_BYTES = 128 << 20
#: Ray namespace of the driver and of the L3 stores when the ray:// URL names none.
DEFAULT_NAMESPACE = "kvstrata"


@contextmanager
def local_ray(
    *, num_cpus: int = 2, namespace: str = DEFAULT_NAMESPACE, attempts: int = 2
) -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 for the duration of the block (no dashboard, no
    worker logs on the driver, a small object store, its own temp dir); yields its address.
    The caller must not be connected to Ray already. On a loaded machine the raylet may miss
    Ray's fixed 30 s registration deadline: `attempts` tries, then RayDidNotStart."""
    tmp = tempfile.mkdtemp(prefix="kvstrata-replay-ray-")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    try:
        errors: list[str] = []
        for _ in range(attempts):
            try:
                with loopback_ray():  # whatever imported Ray first (the CLI's imports do)
                    ray.init(
                        num_cpus=num_cpus,
                        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                        include_dashboard=False,
                        log_to_driver=False,
                        namespace=namespace,
                    )
                break
            except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception on a timeout)
                errors.append(str(exc))
                ray.shutdown()
        else:
            raise RayDidNotStart("; ".join(errors))
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(tmp, ignore_errors=True)  # the session folder of this cluster


def l3_namespace(storage_url: str) -> str:
    """The Ray namespace of the L3 stores a `ray://` URL names (InvalidRayOption otherwise)."""
    url = parse_storage_url(storage_url)
    if url.scheme != "ray":
        raise InvalidRayOption(
            f"the L3 of a Ray cluster replay is ray:// storage, got {storage_url}"
        )
    return url.str_param("namespace", default=DEFAULT_NAMESPACE)


class RayCluster:
    """N `InstanceActor`s on the Ray cluster at `address` (None: a loopback cluster started
    here), sharing the L3 stores of `storage_url` (a `ray://` URL; None: no L3) of
    `l3_bytes` each (needed when the stores are not up yet), routed through the prefix index
    shard actors. Options are checked before Ray is touched (InvalidRayOption)."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        address: str | None = None,
        storage_url: str | None = None,
        l3_bytes: int | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not timeout_s > 0:
            raise InvalidRayOption(f"timeout_s must be > 0, got {timeout_s}")
        if l3_bytes is not None and l3_bytes <= 0:
            raise InvalidRayOption(f"the L3 size must be > 0 bytes, got {l3_bytes}")
        if l3_bytes is not None and storage_url is None:
            raise InvalidRayOption("an L3 size without ray:// storage")
        namespace = l3_namespace(storage_url) if storage_url is not None else None
        self.spec = spec
        self.timeout_s = timeout_s
        self._local: Any = None
        self._namespace = namespace
        self._own_stores = False
        self._own_shards = False
        self._actors: list[Any] = []
        self._closed = False
        if address is None:
            self._local = local_ray()
            self.address = self._local.__enter__()
        else:
            deploy.connect(address)
            self.address = address
        try:
            self._start(storage_url, l3_bytes)
        except BaseException:
            self.close()
            raise

    def _start(self, storage_url: str | None, l3_bytes: int | None) -> None:
        spec = self.spec
        if self._namespace is not None:
            have = [s for s in deploy.status(self._namespace) if s.stats is not None]
            if not have:
                if l3_bytes is None:
                    raise InvalidRayOption(
                        f"no L3 store is up in namespace {self._namespace!r}: give its size "
                        "(--l3-bytes) or run `kvstrata services up` first"
                    )
                self._own_stores = True
                params = StoreParams(memory_bytes=l3_bytes)
                done = deploy.up(
                    StoreConfig(namespace=self._namespace, params=params),
                    timeout_s=self.timeout_s,
                )
                if done.failed:
                    raise InstanceFailed(f"no L3 store started on {', '.join(done.failed)}")
        self._own_shards = self._local is not None or not _shards_up()
        shards = deploy_shards(spec.page_size)
        self._get([h.stats.remote() for h in shards.values()])
        self._index = ClusterIndex(shards, page_size=spec.page_size, timeout_s=self.timeout_s)
        actor_cls = ray.remote(InstanceActor)
        for name in spec.names:
            self._actors.append(
                actor_cls.options(num_cpus=0, max_concurrency=1).remote(
                    name,
                    spec.instance_spec(),
                    storage_url=storage_url,
                    shards=shards,
                    timeout_s=self.timeout_s,
                )
            )
        self._page_bytes: int = self._get(self._actors[0].page_bytes.remote())
        self._l3_bytes: int = self._get(self._actors[0].l3_capacity_bytes.remote())

    def _get(self, refs: Any) -> Any:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except (RayError, GetTimeoutError) as exc:
            raise InstanceFailed(f"a Ray actor of the cluster replay failed: {exc}") from exc

    @property
    def index(self) -> ClusterIndex:
        return self._index

    @property
    def l3_capacity_pages(self) -> int:
        return self._l3_bytes // self._page_bytes

    def serve(self, k: int, request: ReplayRequest) -> Served:
        served = self._get(self._actors[k].serve.remote(request))
        return Served(*served)

    def check_integrity(self) -> None:
        """Every instance's caches (raises the integrity error of the first that fails)."""
        self._get([a.check_integrity.remote() for a in self._actors])

    def close(self) -> None:
        """Stop the instances, take down what this run brought up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Each step runs whatever the one before raised (a dead actor must not leave this
        # run's stores and shards on a cluster given by --address); the first error wins.
        try:
            try:
                try:
                    if self._actors:
                        try:
                            self._get([a.close.remote() for a in self._actors])
                        finally:
                            for actor in self._actors:
                                ray.kill(actor)
                finally:
                    if self._own_stores and self._namespace is not None:
                        deploy.down(self._namespace, timeout_s=self.timeout_s)
            finally:
                if self._own_shards:
                    remove_shards()
        finally:
            if self._local is not None:
                self._local.__exit__(None, None, None)


def _shards_up() -> bool:
    """Whether the prefix index shards of `kvstrata services up` are already running."""
    named = cast("list[dict[str, str]]", ray.util.list_named_actors(all_namespaces=True))
    return any(a["namespace"] == NAMESPACE and a["name"].startswith(NAME_PREFIX) for a in named)
