"""Caller-visible errors of kvstrata.pool.

Every one is raised before the pool changes: a refused call leaves buffers, maps and free lists
as they were. Each also derives from the builtin a caller would naturally catch (`IndexError`
for an index outside the pool, `ValueError` for a malformed argument, `TypeError` for a dtype),
so generic handlers keep working.

`IndexOutOfRange`, `ReservedIndex`, `DuplicateIndex` and `DoubleFree` are the classes of
`kvstrata.core.errors` (shared with the allocator and the host tier), re-exported here; they are
not `PoolError`s. Catch them by name (from here or any layer) or by their builtin base.
"""

from __future__ import annotations

from kvstrata.core.errors import (
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    NotAllocated,
    ReservedIndex,
)

__all__ = [
    "BufferMismatch",
    "DoubleFree",
    "DuplicateIndex",
    "IndexOutOfRange",
    "InvalidArgument",
    "InvalidSpec",
    "LayerOutOfRange",
    "NotAllocated",
    "PoolError",
    "ReservedIndex",
    "RowNotAllocated",
    "SlotMapMissing",
    "UnsupportedDtype",
]


class PoolError(Exception):
    """Base of every error raised by kvstrata.pool."""


class InvalidSpec(PoolError, ValueError):
    """A spec field is out of its domain (non-positive size, overlapping layer ids, ...)."""


class UnsupportedDtype(PoolError, TypeError):
    """A dtype the pools cannot store (supported: bf16, fp16, fp32, fp8 e4m3fn and e5m2)."""


class InvalidArgument(PoolError, ValueError):
    """A malformed argument: an index tensor of float dtype or wrong rank, a negative count,
    a pool size that is not a positive multiple of the page size."""


class BufferMismatch(PoolError, ValueError):
    """A caller's tensor does not fit the pool: wrong shape, dtype, device or inner stride."""


class LayerOutOfRange(PoolError, IndexError):
    """A layer id this pool does not hold (pipeline stages hold a range of global layer ids)."""


class RowNotAllocated(PoolError, NotAllocated):
    """A write into a request row that is not allocated."""


class SlotMapMissing(PoolError, RuntimeError):
    """An SWA translation before the allocator's full-to-SWA map was handed over."""
