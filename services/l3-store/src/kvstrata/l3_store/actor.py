"""StoreActor: the Ray actor that runs one node's `StoreCore`, its arena file and its metrics
endpoint. `deploy.py` places one per node (named, detached, hard node affinity, `num_cpus=0`).

The class is plain Python (deploy wraps it with `ray.remote`), so its calls are what the
engine-side `RayStorage` sends:

| call | by | moves |
|---|---|---|
| `info()` | every client, once per store | the arena path and size, the node id |
| `exists(keys)` | any node | a bool per key |
| `lease(keys)` / `release(id)` | same-node clients | page offsets (client memcpys out) |
| `read(keys)` | other nodes | pages (numpy views, copied once into the object store) + sums |
| `reserve(keys, sizes)` / `commit(id, sums)` | same-node clients | offsets (client memcpys in) |
| `write(keys, pages, sums)` | other nodes | pages (numpy, through the object store) |

The actor runs one call at a time (the default `max_concurrency=1`), so a page returned by
`read` (a numpy view of the arena, pinned by a lease that the next call releases) is copied
into the object store before any later call can spill, evict or reuse it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from prometheus_client import CollectorRegistry, start_http_server

from kvstrata.l3_store.arena import ArenaFile
from kvstrata.l3_store.core import CoreStats, Lease, Reservation, StoreCore, StoreParams
from kvstrata.l3_store.errors import UnknownLease
from kvstrata.l3_store.metrics import StoreCollector
from kvstrata.storage import FileStorage
from kvstrata.storage.base import WriteResult

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """What `kvstrata services up` gives every store. `arena_dir` holds the arena file (tmpfs:
    /dev/shm); `disk_dir` None keeps pages in memory only (each node gets its own
    subdirectory `<disk_dir>/<namespace>-<node id>`). `metrics_port` 0 picks a free port,
    None serves no metrics."""

    namespace: str
    params: StoreParams
    arena_dir: str = "/dev/shm"
    disk_dir: str | None = None
    disk_bytes: int = 0
    metrics_addr: str = "127.0.0.1"
    metrics_port: int | None = 0


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    node_id: str
    arena_path: str
    arena_bytes: int
    metrics_port: int | None
    pid: int


def arena_path(arena_dir: str, namespace: str, node_id: str) -> Path:
    """The arena file of a namespace's store on a node (`node_id` "*" gives a glob)."""
    return Path(arena_dir) / f"kvstrata-l3-{namespace}-{node_id}"


class StoreActor:
    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._node_id = ray.get_runtime_context().get_node_id()
        self._arena = ArenaFile(
            arena_path(config.arena_dir, config.namespace, self._node_id),
            config.params.memory_bytes,
            create=True,
        )
        disk = None
        if config.disk_dir is not None:
            root = Path(config.disk_dir) / f"{config.namespace}-{self._node_id}"
            root.mkdir(parents=True, exist_ok=True)
            disk = FileStorage(root, capacity_bytes=config.disk_bytes, namespace=config.namespace)
        self._core = StoreCore(config.params, arena=self._arena.view, disk=disk)
        self._disk = disk
        self._metrics_port: int | None = None
        if config.metrics_port is not None:
            registry = CollectorRegistry()
            registry.register(StoreCollector(self._core.stats))
            server, _thread = start_http_server(
                config.metrics_port, addr=config.metrics_addr, registry=registry
            )
            self._metrics_port = server.server_port
        self._pid = os.getpid()
        self._read_leases: list[int] = []  # leases of `read` results, released by `_settle`

    def _settle(self) -> None:
        """Release the leases of earlier `read` calls (first thing in every call): Ray has
        copied their pages into the object store by then, because the actor runs one call at a
        time and serialises a call's return value before it starts the next."""
        while self._read_leases:
            lease_id = self._read_leases.pop()
            try:
                self._core.release(lease_id)
            except UnknownLease:
                _log.debug("read lease %d expired before the next call", lease_id)

    def info(self) -> StoreInfo:
        self._settle()
        return StoreInfo(
            node_id=self._node_id,
            arena_path=str(self._arena.path),
            arena_bytes=self._arena.size_bytes,
            metrics_port=self._metrics_port,
            pid=self._pid,
        )

    def exists(self, keys: list[bytes]) -> list[bool]:
        self._settle()
        return self._core.exists(keys)

    def lease(self, keys: list[bytes]) -> Lease:
        self._settle()
        return self._core.lease(keys)

    def release(self, lease_id: int) -> None:
        self._settle()
        self._core.release(lease_id)

    def read(self, keys: list[bytes]) -> tuple[list[np.ndarray | None], list[int]]:
        """The pages as numpy arrays over the arena itself (no copy here: Ray's serialisation
        of the return value is the one copy, into the object store), pinned until the next
        call (`_settle`)."""
        self._settle()
        grant = self._core.lease(keys)
        if grant.lease_id is not None:
            self._read_leases.append(grant.lease_id)
        pages = [
            None if r is None else np.frombuffer(self._core.view(r), dtype=np.uint8)
            for r in grant.refs
        ]
        return pages, [0 if r is None else r.checksum for r in grant.refs]

    def reserve(self, keys: list[bytes], sizes: list[int]) -> Reservation:
        self._settle()
        return self._core.reserve(keys, sizes)

    def commit(self, reservation_id: int, checksums: list[int]) -> list[str]:
        """A same-node writer's commit: its checksums were computed over the arena bytes it
        wrote (`copy_checksum`), so they are taken without a second pass; every reader checks
        them after its copy."""
        self._settle()
        return [r.value for r in self._core.commit(reservation_id, checksums, verify=False)]

    def write(self, keys: list[bytes], pages: list[np.ndarray], checksums: list[int]) -> list[str]:
        self._settle()
        views = [p.data.cast("B") for p in pages]
        return [r.value for r in self._core.write_verified(keys, views, checksums)]

    def delete(self, keys: list[bytes]) -> int:
        self._settle()
        return self._core.delete(keys)

    def clear(self) -> None:
        self._settle()
        self._core.clear()

    def stats(self) -> CoreStats:
        self._settle()
        self._core.expire()
        return self._core.stats()

    def check_integrity(self) -> None:
        self._settle()
        self._core.check_integrity()

    def close(self) -> None:
        """Remove what the store left on the node (arena file, spilled pages). The actor is
        killed right after; its mapping goes with the process."""
        self._settle()
        self._core.clear()
        if self._disk is not None:
            self._disk.close()
            for leftover in self._disk.path.rglob("*"):
                if leftover.is_file():
                    leftover.unlink()
            for sub in sorted(self._disk.path.rglob("*"), reverse=True):
                sub.rmdir()
            self._disk.path.rmdir()
        self._arena.unlink()
        _log.info("l3 store on node %s closed", self._node_id)


def write_results(values: list[str]) -> list[WriteResult]:
    return [WriteResult(v) for v in values]
