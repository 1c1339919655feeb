"""Device KV-cache and SSM-state pools (L1).

Build a pool from a family spec: `MHAKVPool(MHASpec(...), size=, page_size=, device=)`.
Layout, page format and costs: the package README. `DevicePool` (the base MambaPool and
KVPool share) and `PageIOCounters` live in `kvstrata.pool.base`.
"""

from __future__ import annotations

from kvstrata.pool.base import KVPool, LayerRoute
from kvstrata.pool.errors import (
    BufferMismatch,
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidArgument,
    InvalidSpec,
    LayerOutOfRange,
    PoolError,
    ReservedIndex,
    RowNotAllocated,
    SlotMapMissing,
    UnsupportedDtype,
)
from kvstrata.pool.mamba import MambaPool
from kvstrata.pool.metrics import PoolCollector
from kvstrata.pool.mha import MHAKVPool
from kvstrata.pool.mla import MLAKVPool
from kvstrata.pool.req_to_token import ReqToTokenPool
from kvstrata.pool.spec import MambaSpec, MHASpec, MLASpec, SWASpec
from kvstrata.pool.swa import SWAKVPool

__all__ = [
    "BufferMismatch",
    "DoubleFree",
    "DuplicateIndex",
    "IndexOutOfRange",
    "InvalidArgument",
    "InvalidSpec",
    "KVPool",
    "LayerOutOfRange",
    "LayerRoute",
    "MHAKVPool",
    "MHASpec",
    "MLAKVPool",
    "MLASpec",
    "MambaPool",
    "MambaSpec",
    "PoolCollector",
    "PoolError",
    "ReqToTokenPool",
    "ReservedIndex",
    "RowNotAllocated",
    "SWAKVPool",
    "SWASpec",
    "SlotMapMissing",
    "UnsupportedDtype",
]
