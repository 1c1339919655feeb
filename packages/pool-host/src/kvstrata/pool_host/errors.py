"""Errors a caller of kvstrata.pool_host can see.

Every one is raised before any state changes: a refused transfer has copied nothing, a refused
allocation or free has left the allocator as it was, a refused pool size has allocated nothing.

`IndexOutOfRange`, `MisalignedIndex`, `ReservedIndex`, `DuplicateIndex`, `DoubleFree`,
`BufferSizeMismatch` and `LayerLoadFailed` are the classes of `kvstrata.core.errors` (shared with
the device pools, the allocator, storage and the tier controller), re-exported here; they are not
`HostPoolError`s. Catch them by name (from here or any layer) or by their builtin base.
"""

from __future__ import annotations

from kvstrata.core.errors import (
    BufferSizeMismatch,
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    IntegrityError,
    LayerLoadFailed,
    MisalignedIndex,
    ReservedIndex,
)

__all__ = [
    "BufferSizeMismatch",
    "DoubleAllocation",
    "DoubleFree",
    "DuplicateIndex",
    "HostAllocatorError",
    "HostPoolError",
    "HostPoolTooSmall",
    "IndexLengthMismatch",
    "IndexOutOfRange",
    "InsufficientHostMemory",
    "IntegrityError",
    "InvalidHostPoolSize",
    "InvalidIndices",
    "LayerAlreadyLoaded",
    "LayerIdOutOfRange",
    "LayerLoadFailed",
    "LayerWaitTimeout",
    "MisalignedIndex",
    "NonIntegerIndex",
    "PageNotContiguous",
    "PinnedMemoryUnavailable",
    "PoolMismatch",
    "ReservedIndex",
    "SharedMemoryError",
    "SizeNotPageAligned",
    "UnknownPoolName",
]


class HostPoolError(Exception):
    """Base of every error raised by kvstrata.pool_host."""


# --- sizing and memory ---------------------------------------------------------------------------


class InvalidHostPoolSize(HostPoolError):
    """The size options of a host pool are missing, conflicting or negative."""


class HostPoolTooSmall(InvalidHostPoolSize):
    """The requested host pool holds less than one page."""


class InsufficientHostMemory(HostPoolError):
    """The requested host pool does not fit in this host's memory (or its /dev/shm)."""


class PinnedMemoryUnavailable(HostPoolError):
    """Pinned (page-locked) host memory was asked for, but CUDA is not available."""


class SharedMemoryError(HostPoolError):
    """A shared-memory region could not be created or attached."""


# --- transfers -----------------------------------------------------------------------------------


class InvalidIndices(HostPoolError):
    """Base of the index errors of backup/load/page I/O."""


class IndexLengthMismatch(InvalidIndices):
    """Device and host index tensors differ in length, or a length is not whole pages."""


class NonIntegerIndex(InvalidIndices, MisalignedIndex):
    """An index tensor of a float, complex or bool dtype (a float would be truncated to some
    other page). A MisalignedIndex, which transfers raised for such tensors before."""


class PoolMismatch(HostPoolError):
    """The device pool passed to a transfer does not have the buffers this host pool mirrors."""


class LayerIdOutOfRange(HostPoolError):
    """A layer id that the mirrored device pool does not hold."""


class PageNotContiguous(HostPoolError):
    """A zero-copy page view was asked of a layout whose pages are not contiguous (layer_first)."""


class LayerWaitTimeout(HostPoolError):
    """A layer did not arrive within the timeout given to LayerCompletion.wait."""


class LayerAlreadyLoaded(HostPoolError):
    """A load would mark a layer its LayerCompletion already holds as loaded (or the same layer
    twice in one load_layers): refused before the copy, so waiters never see the layer twice."""


class UnknownPoolName(HostPoolError):
    """HostPoolCollector got an allocator under a name that no host pool was given."""


# --- host slot allocator -------------------------------------------------------------------------


class HostAllocatorError(HostPoolError):
    """Base of the errors of HostSlotAllocator."""


class SizeNotPageAligned(HostAllocatorError):
    """A token count or index set that is not whole pages was given to the page allocator."""


#: A page on the free list that is already allocated (the list was corrupted from outside): the
#: shared `IntegrityError`, which `kvstrata.core.free_ids.FreeIds.take` raises. The old name stays.
DoubleAllocation = IntegrityError
