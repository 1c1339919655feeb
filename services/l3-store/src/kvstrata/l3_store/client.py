"""RayStorage: the engine side of the shared L3 tier, a `Storage` over the node stores.

`open_storage("ray://?namespace=kvstrata&timeout_ms=1000")` opens one (through the
`kvstrata.storage_backends` entry point). Routing:

- get: the local node's store (leased, then one checked copy per page out of the arena this
  process maps) and each page's home store (rendezvous hashing over the stores that answer),
  all asked at once, pages from other nodes coming back through the object store; a page the
  local store holds is taken from there;
- set: each page goes to its home store (same node: reserve, memcpy into the arena, commit;
  other nodes: one `write` call per home with the pages as numpy arrays);
- exists: the local store and every home store asked in parallel; the count stops at the
  first key that none of them holds.

Every call has a deadline (`timeout_s`). A store that fails or misses it is left out of the
view until the next refresh (`refresh_s`), its pages are misses and its writes are dropped and
counted (`dropped_writes`), never an exception out of a batch call. With no store at all
(before `kvstrata services up`) every get misses and every set is dropped.

Every page is checked against the checksum its store keeps (xxh3_64, computed by the writer);
a page that fails is a miss (`corrupt_pages`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from kvstrata.l3_store.actor import StoreInfo
from kvstrata.l3_store.arena import ArenaFile
from kvstrata.l3_store.core import Lease, Reservation, checksum, copy_checksum
from kvstrata.l3_store.deploy import alive_nodes, connect, store_name
from kvstrata.l3_store.errors import ArenaMismatch, InvalidStoreConfig
from kvstrata.l3_store.routing import group_by_home
from kvstrata.storage.base import Occupancy, Storage, WriteResult
from kvstrata.storage.errors import BufferSizeMismatch
from kvstrata.storage.registry import StorageURL

_FAILURES = (RayError, GetTimeoutError)


@dataclass
class _Store:
    node_id: str
    handle: Any
    info: StoreInfo
    arena: ArenaFile | None  # mapped when the store is on this node


@dataclass(frozen=True)
class ClientCounters:
    dropped_writes: int  # pages not stored because their store failed or timed out
    store_errors: int  # calls that failed or timed out
    local_pages: int  # pages read or written through the shared-memory arena
    remote_pages: int  # pages read or written through the object store
    refreshes: int


class RayStorage(Storage):
    """Pages in the node stores of Ray namespace `namespace`. Thread-safe."""

    max_key_bytes = 120  # the stores spill through FileStorage (keys become file names)

    def __init__(
        self,
        *,
        namespace: str = "kvstrata",
        timeout_s: float = 1.0,
        refresh_s: float = 2.0,
        address: str = "auto",
    ) -> None:
        if not timeout_s > 0 or not refresh_s > 0:
            raise InvalidStoreConfig(
                f"timeout_s and refresh_s must be > 0, got {timeout_s} and {refresh_s}"
            )
        connect(address)
        super().__init__()
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.node_id = ray.get_runtime_context().get_node_id()
        self._stores: dict[str, _Store] = {}
        self._refreshed_at = -float("inf")
        self._view_lock = threading.Lock()
        self._n = {"dropped_writes": 0, "store_errors": 0, "local_pages": 0,
                   "remote_pages": 0, "refreshes": 0}  # fmt: skip
        self._n_lock = threading.Lock()

    # ------------------------------------------------------------------ view of the stores

    def stores(self) -> dict[str, _Store]:
        """The stores that answered the last refresh (refreshed when older than refresh_s)."""
        with self._view_lock:
            if time.monotonic() - self._refreshed_at >= self.refresh_s:
                self._refresh_locked()
            return dict(self._stores)

    def refresh(self) -> None:
        with self._view_lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        self._refreshed_at = time.monotonic()
        self._count("refreshes")
        asked: dict[str, tuple[Any, Any]] = {}
        try:
            nodes = alive_nodes()
        except _FAILURES:
            self._count("store_errors")
            return
        for node_id in nodes:
            try:
                handle = ray.get_actor(store_name(node_id), namespace=self.namespace)
            except ValueError:  # no store on that node (not up yet, or it died)
                continue
            asked[node_id] = (handle, handle.info.remote())
        fresh: dict[str, _Store] = {}
        deadline = time.monotonic() + self.timeout_s
        for node_id, (handle, ref) in asked.items():
            info = self._get(ref, deadline)
            if info is None:
                continue
            old = self._stores.get(node_id)
            if old is not None and old.info == info:
                fresh[node_id] = _Store(node_id, handle, info, old.arena)
                continue
            if old is not None and old.arena is not None:
                old.arena.close()
            arena = None
            if node_id == self.node_id:
                try:
                    arena = ArenaFile(Path(info.arena_path), info.arena_bytes, create=False)
                except (OSError, ArenaMismatch):
                    arena = None  # not mappable from here: go through the object store
            fresh[node_id] = _Store(node_id, handle, info, arena)
        for node_id, old in self._stores.items():
            if node_id not in fresh and old.arena is not None:
                old.arena.close()
        self._stores = fresh

    def _forget(self, node_id: str) -> None:
        """A store failed a call: leave it out until the next refresh finds it answering."""
        with self._view_lock:
            gone = self._stores.pop(node_id, None)
            if gone is not None and gone.arena is not None:
                gone.arena.close()
        self._count("store_errors")

    def _get(self, ref: Any, deadline: float) -> Any | None:
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.001))
        except _FAILURES:
            return None

    def _count(self, name: str, n: int = 1) -> None:
        with self._n_lock:
            self._n[name] += n

    def counters(self) -> ClientCounters:
        with self._n_lock:
            return ClientCounters(**self._n)

    # ------------------------------------------------------------------ Storage hooks

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        stores = self.stores()
        present = [False] * len(keys)
        asked = []
        local = stores.get(self.node_id)
        if local is not None:
            asked.append((local.node_id, list(range(len(keys))), local.handle.exists.remote(keys)))
        for node_id, idx in group_by_home(keys, sorted(stores)).items():
            if node_id != self.node_id:
                ref = stores[node_id].handle.exists.remote([keys[i] for i in idx])
                asked.append((node_id, idx, ref))
        deadline = time.monotonic() + self.timeout_s
        for node_id, idx, ref in asked:
            mask = self._get(ref, deadline)
            if mask is None:
                self._forget(node_id)
                continue
            for i, here in zip(idx, mask, strict=True):
                present[i] = present[i] or here
        return next((i for i, p in enumerate(present) if not p), len(keys))

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        stores = self.stores()
        deadline = time.monotonic() + self.timeout_s
        local = stores.get(self.node_id)
        grant: Lease | None = None
        pages: list[memoryview | np.ndarray | None] = [None] * len(keys)
        sums = [0] * len(keys)
        # The local store (all keys) and every other home store (its keys) are asked at once:
        # a set puts a page in its home store only, so the homes' answers are rarely wasted,
        # and a get costs one round trip, not two. A page both hold is taken from here.
        lease_ref = None
        if local is not None and local.arena is not None:
            lease_ref = local.handle.lease.remote(list(keys))
        asked = []
        for node_id, idx in group_by_home(keys, sorted(stores)).items():
            if node_id == self.node_id and lease_ref is not None:
                continue  # the local store is asked already
            asked.append((node_id, idx, stores[node_id].handle.read.remote([keys[i] for i in idx])))
        if lease_ref is not None and local is not None and local.arena is not None:
            grant = self._get(lease_ref, deadline)
            if grant is None:
                self._forget(local.node_id)
            else:
                for i, ref in enumerate(grant.refs):
                    if ref is not None:
                        pages[i] = local.arena.view[ref.offset : ref.offset + ref.size]
                        sums[i] = ref.checksum
        for node_id, at, ref in asked:
            got = self._get(ref, deadline)
            if got is None:
                self._forget(node_id)
                continue
            arrays, checksums = got
            for i, array, s in zip(at, arrays, checksums, strict=True):
                if array is not None and pages[i] is None:
                    pages[i], sums[i] = array, s
        try:
            for key, page, view in zip(keys, pages, views, strict=True):
                if page is not None and page.nbytes != view.nbytes:
                    raise BufferSizeMismatch(
                        f"page {key.hex()[:16]} has {page.nbytes} bytes, its buffer {view.nbytes}"
                    )
            found = [False] * len(keys)
            num_local = 0
            for i, (page, view) in enumerate(zip(pages, views, strict=True)):
                if page is None:
                    continue
                src = page if isinstance(page, memoryview) else page.data.cast("B")
                if copy_checksum(view, src) != sums[i]:
                    self._count_corrupt(1)
                    continue
                found[i] = True
                num_local += isinstance(page, memoryview)
        finally:
            if grant is not None and grant.lease_id is not None and local is not None:
                local.handle.release.remote(grant.lease_id)  # nobody waits for the unpin
        self._count("local_pages", num_local)
        self._count("remote_pages", sum(found) - num_local)
        return found

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        stores = self.stores()
        results = [WriteResult.FAILED] * len(keys)
        groups = group_by_home(keys, sorted(stores))
        if not groups:
            self._count("dropped_writes", len(keys))
            return results
        deadline = time.monotonic() + self.timeout_s
        asked = []
        for node_id, idx in groups.items():
            store = stores[node_id]
            if store.arena is not None:
                continue  # written below, through the arena
            arrays = [np.frombuffer(views[i], dtype=np.uint8) for i in idx]
            sums = [checksum(views[i]) for i in idx]
            ref = store.handle.write.remote([keys[i] for i in idx], arrays, sums)
            asked.append((node_id, idx, ref))
        for node_id, idx in groups.items():
            store = stores[node_id]
            if store.arena is not None:
                self._set_local(store, [keys[i] for i in idx], [views[i] for i in idx], deadline,
                                into=results, at=idx)  # fmt: skip
        for node_id, idx, ref in asked:
            got = self._get(ref, deadline)
            if got is None:
                self._forget(node_id)
                self._count("dropped_writes", len(idx))
                continue
            for i, value in zip(idx, got, strict=True):
                results[i] = WriteResult(value)
            self._count("remote_pages", len(idx))
        return results

    def _set_local(
        self,
        store: _Store,
        keys: list[bytes],
        views: list[memoryview],
        deadline: float,
        *,
        into: list[WriteResult],
        at: list[int],
    ) -> None:
        assert store.arena is not None, "_set_local needs the store's arena mapped"
        grant: Reservation | None = self._get(
            store.handle.reserve.remote(keys, [v.nbytes for v in views]), deadline
        )
        if grant is None:
            self._forget(store.node_id)
            self._count("dropped_writes", len(keys))
            return
        sums = [0] * len(keys)
        for j, (offset, view) in enumerate(zip(grant.offsets, views, strict=True)):
            if offset is not None:
                sums[j] = copy_checksum(store.arena.view[offset : offset + view.nbytes], view)
            elif grant.present[j]:
                into[at[j]] = WriteResult.PRESENT
        if grant.reservation_id is None:
            return
        got = self._get(store.handle.commit.remote(grant.reservation_id, sums), deadline)
        if got is None:
            self._forget(store.node_id)
            self._count("dropped_writes", len(keys))
            return
        for j, value in enumerate(got):
            into[at[j]] = WriteResult(value)
        self._count("local_pages", len(keys))

    def _delete(self, keys: Sequence[bytes]) -> int:
        stores = self.stores()
        refs = [(n, s.handle.delete.remote(list(keys))) for n, s in stores.items()]
        deadline = time.monotonic() + self.timeout_s
        removed = 0
        for node_id, ref in refs:
            got = self._get(ref, deadline)
            if got is None:
                self._forget(node_id)
            else:
                removed += got
        return removed

    def _clear(self) -> None:
        stores = self.stores()
        refs = [(n, s.handle.clear.remote()) for n, s in stores.items()]
        deadline = time.monotonic() + self.timeout_s
        for node_id, ref in refs:
            if self._get(ref, deadline) is None:
                self._forget(node_id)

    def _occupancy(self) -> Occupancy:
        stores = self.stores()
        refs = [(n, s.handle.stats.remote()) for n, s in stores.items()]
        deadline = time.monotonic() + self.timeout_s
        pages = used = capacity = 0
        for node_id, ref in refs:
            stats = self._get(ref, deadline)
            if stats is None:
                self._forget(node_id)
                continue
            pages += stats.memory_pages + stats.disk_pages
            used += stats.memory_used_bytes + stats.disk_used_bytes
            capacity += stats.memory_capacity_bytes + stats.disk_capacity_bytes
        return Occupancy(pages, used, capacity)

    def check_integrity(self) -> None:
        with self._view_lock:
            for node_id, store in self._stores.items():
                assert store.node_id == node_id == store.info.node_id, "view keyed by wrong node"
                assert store.arena is None or node_id == self.node_id, "mapped a remote arena"
        counters = self.counters()
        assert counters.dropped_writes <= self.stats().write_failures, (
            "a dropped write was not reported FAILED"
        )

    def close(self) -> None:
        """Unmap the local arena (the stores are untouched)."""
        with self._view_lock:
            for store in self._stores.values():
                if store.arena is not None:
                    store.arena.close()
            self._stores = {}
            self._refreshed_at = -float("inf")


def open_ray_storage(url: StorageURL) -> RayStorage:
    """The `ray://` factory: `ray://?namespace=kvstrata&timeout_ms=1000&refresh_ms=2000
    &address=auto` (every parameter optional)."""
    url.check_params({"namespace", "timeout_ms", "refresh_ms", "address"})
    if url.host or url.path not in ("", "/"):
        raise InvalidStoreConfig(f"{url.url}: ray:// takes no host or path, only parameters")
    return RayStorage(
        namespace=url.str_param("namespace", default="kvstrata"),
        timeout_s=url.int_param("timeout_ms", default=1000, minimum=1) / 1000,
        refresh_s=url.int_param("refresh_ms", default=2000, minimum=1) / 1000,
        address=url.str_param("address", default="auto"),
    )
