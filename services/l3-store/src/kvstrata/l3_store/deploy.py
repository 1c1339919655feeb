"""Lifecycle of the stores: one per alive Ray node, created, reconciled, listed, removed.

- `up(config)` creates the missing stores (named `kvstrata-l3-store-<node id>` in the Ray
  namespace `config.namespace`, detached, pinned with hard node affinity, `num_cpus=0`) and starts
  a supervisor actor (detached, named `kvstrata-l3-supervisor`) that reconciles every
  `reconcile_s`: a node that joins gets a store; a store that died on a live node is
  recreated; a node that left takes its store with it. `up` is idempotent.
- `status(namespace)` reads every store's stats (a store that does not answer within the
  timeout shows as down).
- `down(namespace)` stops the supervisor, closes every store (removes its arena file and
  spilled pages) and kills it, then sweeps every alive node for arena files of the namespace
  left by stores that died without closing.

Ray must be initialised by the caller (`ray.init(address=..., namespace=...)`).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstrata.l3_store.actor import StoreActor, StoreConfig, StoreInfo, arena_path
from kvstrata.l3_store.core import CoreStats
from kvstrata.l3_store.errors import InvalidStoreConfig, RayNotConnected

_log = logging.getLogger(__name__)

STORE_PREFIX = "kvstrata-l3-store-"
SUPERVISOR = "kvstrata-l3-supervisor"


def store_name(node_id: str) -> str:
    return STORE_PREFIX + node_id


def alive_nodes() -> list[str]:
    """Node ids of the alive Ray nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def _named(name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:  # no actor by that name (never created, or dead)
        return None


def _store(node_id: str, namespace: str) -> Any | None:
    return _named(store_name(node_id), namespace)


def _check(config: StoreConfig) -> None:
    if not config.namespace or not all(c.isalnum() or c in "-_" for c in config.namespace):
        raise InvalidStoreConfig(
            f"namespace {config.namespace!r}: use letters, digits, '-' and '_' only"
        )
    if config.disk_dir is not None and config.disk_bytes <= 0:
        raise InvalidStoreConfig("a disk directory needs disk_bytes > 0")


@dataclass(frozen=True)
class Reconciled:
    """What one reconciliation did: stores created, and nodes whose store did not start."""

    created: list[str]
    failed: list[str]


def reconcile(config: StoreConfig, *, timeout_s: float = 60.0) -> Reconciled:
    """Create the store of every alive node that has none, and wait until each answers."""
    _check(config)
    created: dict[str, Any] = {}
    for node_id in alive_nodes():
        if _store(node_id, config.namespace) is not None:
            continue
        created[node_id] = (
            ray.remote(StoreActor)
            .options(
                name=store_name(node_id),
                namespace=config.namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(config)
        )
    failed: list[str] = []
    for node_id, handle in created.items():
        try:
            info: StoreInfo = ray.get(handle.info.remote(), timeout=timeout_s)
            assert info.node_id == node_id, f"store for {node_id} landed on {info.node_id}"
        except (RayError, GetTimeoutError) as exc:
            _log.warning("l3 store on node %s did not start: %s", node_id, exc)
            failed.append(node_id)
    return Reconciled(created=sorted(set(created) - set(failed)), failed=failed)


class Supervisor:
    """Reconciles every `interval_s` on a background thread until `stop`."""

    def __init__(self, config: StoreConfig, interval_s: float) -> None:
        self._config = config
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.rounds = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="l3-reconcile", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                reconcile(self._config)
            except RayError:
                self.errors += 1  # the GCS hiccuped: the next round tries again
            self.rounds += 1

    def counters(self) -> tuple[int, int]:
        return self.rounds, self.errors

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def up(config: StoreConfig, *, reconcile_s: float = 5.0, timeout_s: float = 60.0) -> Reconciled:
    """Create the missing stores now, and the supervisor that keeps reconciling."""
    if not reconcile_s > 0:
        raise InvalidStoreConfig(f"reconcile_s must be > 0, got {reconcile_s}")
    done = reconcile(config, timeout_s=timeout_s)
    ray.remote(Supervisor).options(
        name=SUPERVISOR,
        namespace=config.namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=2,
    ).remote(config, reconcile_s)
    return done


@dataclass(frozen=True)
class StoreStatus:
    node_id: str
    stats: CoreStats | None  # None: the store did not answer (or there is none)


def status(namespace: str, *, timeout_s: float = 5.0) -> list[StoreStatus]:
    """One row per alive node, asked in parallel."""
    nodes = alive_nodes()
    pending = {}
    for node_id in nodes:
        handle = _store(node_id, namespace)
        if handle is not None:
            pending[node_id] = handle.stats.remote()
    rows = []
    for node_id in nodes:
        stats: CoreStats | None = None
        if node_id in pending:
            try:
                stats = ray.get(pending[node_id], timeout=timeout_s)
            except (RayError, GetTimeoutError):
                stats = None
        rows.append(StoreStatus(node_id, stats))
    return rows


def _sweep(pattern: str) -> int:
    removed = 0
    for path in glob.glob(pattern):
        os.unlink(path)
        removed += 1
    return removed


def down(namespace: str, *, arena_dir: str = "/dev/shm", timeout_s: float = 30.0) -> int:
    """Stop the supervisor and every store of `namespace`; returns how many stores went."""
    supervisor = _named(SUPERVISOR, namespace)
    if supervisor is not None:
        try:
            ray.get(supervisor.stop.remote(), timeout=timeout_s)
        except (RayError, GetTimeoutError) as exc:
            _log.warning("l3 supervisor did not stop cleanly (%s); killing it", exc)
        ray.kill(supervisor)
    gone = 0
    for node_id in alive_nodes():
        handle = _store(node_id, namespace)
        if handle is None:
            continue
        try:
            ray.get(handle.close.remote(), timeout=timeout_s)
        except (RayError, GetTimeoutError) as exc:
            # Killed all the same; the sweep below removes its arena file.
            _log.warning("l3 store on %s did not close (%s); killing it", node_id, exc)
        ray.kill(handle)
        gone += 1
    # Stores that died without closing left their arena files: sweep every node.
    pattern = str(arena_path(arena_dir, namespace, "*"))
    sweeps = [
        ray.remote(_sweep)
        .options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        )
        .remote(pattern)
        for node_id in alive_nodes()
    ]
    ray.get(sweeps, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (
        _named(SUPERVISOR, namespace) is not None
        or any(_store(n, namespace) is not None for n in alive_nodes())
    ):
        time.sleep(0.05)  # ray.kill is asynchronous: wait until the names are free
    return gone


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one this machine belongs to) as a
    driver, unless this process is connected already. RayNotConnected when there is none."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    except ConnectionError as exc:
        raise RayNotConnected(f"no Ray cluster at {address!r}: {exc}") from exc
