"""KvstrataHiCacheStorage: SGLang's HiCache L3 backend over any kvstrata storage URL.

SGLang loads it with

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
        "module_path": "kvstrata.l3_store.sglang", "class_name": "KvstrataHiCacheStorage",
        "url": "ray://?namespace=kvstrata&timeout_ms=1000"}'

`url` defaults to `ray://` (the node stores of `kvstrata services up`); `file:///dir?...` and
`memory://?...` work as well, so a single-node SGLang adopts it without Ray (Ray is imported
only when the URL is `ray://`). This module imports SGLang: install the adapter where SGLang
runs (SGLang 0.5.23's API).

Keys: SGLang's page hashes (hex strings) are suffixed as SGLang's own file backend does (model,
and the TP rank and size unless the model is MLA, whose KV is the same on every rank), then
hashed to 32 bytes, so that two ranks never share a page that differs between them.

Pages move between SGLang's host pool and the storage as flat byte pages: `batch_set_v1` reads
`mem_pool_host.get_data_page(index)` (one contiguous page), `batch_get_v1` reads each page into
a flat page buffer and copies the hits in with `set_from_flat_data_page`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # pyright: ignore[reportMissingImports]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstrata.storage import Storage, open_storage

DEFAULT_URL = "ray://"


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as flat bytes (the tensor must be contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


class KvstrataHiCacheStorage(HiCacheStorage):
    """A `HiCacheStorage` over `open_storage(extra_config["url"])`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        extra = dict(storage_config.extra_config or {})
        self.url: str = extra.get("url", DEFAULT_URL)
        self.storage: Storage = open_storage(self.url)
        model = "-".join((storage_config.model_name or "").split("/"))
        if storage_config.is_mla_model:
            self._suffix = f"_{model}"
        else:
            self._suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            self._suffix += f"_{storage_config.pp_size}_{storage_config.pp_rank}"
        self.mem_pool_host: Any = (kwargs or {}).get("mem_pool_host")
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []

    def _key(self, key: str) -> bytes:
        return hashlib.blake2b((key + self._suffix).encode(), digest_size=32).digest()

    # ------------------------------------------------------------------ v1: host pool pages

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        page = pool.page_size
        start = time.perf_counter()
        buffers = [pool.get_dummy_flat_data_page() for _ in keys]
        found = self.storage.batch_get(
            [self._key(k) for k in keys], [_byte_view(b) for b in buffers]
        )
        for i, ok in enumerate(found):
            if ok:
                pool.set_from_flat_data_page(int(host_indices[i * page]), buffers[i])
        self._record(self._prefetch_pgs, self._prefetch_bandwidth, buffers, found, start)
        return found

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        page = pool.page_size
        start = time.perf_counter()
        pages = [
            pool.get_data_page(int(host_indices[i * page]), flat=True).contiguous()
            for i in range(len(keys))
        ]
        stored = self.storage.batch_set(
            [self._key(k) for k in keys], [_byte_view(p) for p in pages]
        )
        self._record(self._backup_pgs, self._backup_bandwidth, pages, stored, start)
        return stored

    # ------------------------------------------------------------------ tensors by key

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        if target_location is None:
            return None  # a page's size is the caller's buffer: nothing to read into
        ok = self.storage.batch_get([self._key(key)], [_byte_view(target_location)])[0]
        return target_location if ok else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if target_locations is None:
            return [None] * len(keys)
        found = self.storage.batch_get(
            [self._key(k) for k in keys], [_byte_view(t) for t in target_locations]
        )
        return [t if ok else None for t, ok in zip(target_locations, found, strict=True)]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        tensor = value if value is not None else target_location
        if tensor is None:
            return False
        return self.storage.batch_set([self._key(key)], [_byte_view(tensor.contiguous())])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        tensors = values if values is not None else target_locations
        if tensors is None:
            return False
        stored = self.storage.batch_set(
            [self._key(k) for k in keys], [_byte_view(t.contiguous()) for t in tensors]
        )
        return all(stored)

    def exists(self, key: str) -> bool:
        return self.storage.batch_exists([self._key(key)]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many keys, from the first, are stored consecutively (one storage call)."""
        return self.storage.batch_exists([self._key(k) for k in keys])

    def clear(self) -> None:
        self.storage.clear()

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the calls since the last `get_stats` (then reset)."""
        from sglang.srt.observability.metrics_collector import (  # pyright: ignore[reportMissingImports]
            StorageMetrics,
        )

        with self._metrics_lock:
            metrics = StorageMetrics(
                prefetch_pgs=self._prefetch_pgs,
                backup_pgs=self._backup_pgs,
                prefetch_bandwidth=self._prefetch_bandwidth,
                backup_bandwidth=self._backup_bandwidth,
            )
            self._prefetch_pgs, self._backup_pgs = [], []
            self._prefetch_bandwidth, self._backup_bandwidth = [], []
        return metrics

    def _record(
        self,
        pages: list[int],
        bandwidth: list[float],
        tensors: list[torch.Tensor],
        ok: list[bool],
        start: float,
    ) -> None:
        elapsed = time.perf_counter() - start
        moved = sum(
            t.numel() * t.element_size() for t, good in zip(tensors, ok, strict=True) if good
        )
        with self._metrics_lock:
            pages.append(sum(ok))
            bandwidth.append(moved / elapsed / 1e9 if elapsed > 0 else 0.0)
