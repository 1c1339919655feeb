"""L3 storage backends and the chained page key scheme.

`Storage` is the interface (batch_exists / batch_get / batch_set / delete / clear / stats);
`MemoryStorage` and `FileStorage` implement it, `open_storage(url)` opens one by URL and
`register_backend` adds schemes (a factory receives a `StorageURL`). `PageKeyer` names pages by
their token prefix. `FaultInjectingStorage` (with `FaultRules`) fails, delays or corrupts chosen
pages for tests. Errors live in `kvstrata.storage.errors`; a backend implements the hooks of
`kvstrata.storage.base.Storage`.
"""

from __future__ import annotations

from kvstrata.storage.base import Storage, StorageStats
from kvstrata.storage.faults import FaultInjectingStorage, FaultRules
from kvstrata.storage.file import FileStorage
from kvstrata.storage.keys import PageKeyer
from kvstrata.storage.memory import MemoryStorage
from kvstrata.storage.metrics import StorageCollector
from kvstrata.storage.registry import StorageURL, open_storage, register_backend

__all__ = [
    "FaultInjectingStorage",
    "FaultRules",
    "FileStorage",
    "MemoryStorage",
    "PageKeyer",
    "Storage",
    "StorageCollector",
    "StorageStats",
    "StorageURL",
    "open_storage",
    "register_backend",
]
