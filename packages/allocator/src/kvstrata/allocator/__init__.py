"""Device KV slot allocators: token, paged, sliding-window, Mamba state.

`need_size -> indices`: which device slots are free. Allocation never evicts and changes
nothing when it fails; bad indices raise from `kvstrata.allocator.errors` before any change.
"""

from __future__ import annotations

from kvstrata.allocator.base import AllocatorCounters, AllocatorState, PoolUsage, SlotAllocator
from kvstrata.allocator.counting import SlotCounter
from kvstrata.allocator.errors import (
    AllocatorError,
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    IntegrityError,
    InvalidRequest,
    MisalignedIndex,
    NotAllocated,
    ReservedIndex,
)
from kvstrata.allocator.mamba import MambaSlotAllocator, SlotCopy
from kvstrata.allocator.metrics import AllocatorCollector
from kvstrata.allocator.paged import PagedAllocator, PagedState, PageSlotAllocator
from kvstrata.allocator.swa import SWAAllocator, SWAState
from kvstrata.allocator.token import TokenAllocator

__all__ = [
    "AllocatorCollector",
    "AllocatorCounters",
    "AllocatorError",
    "AllocatorState",
    "DoubleFree",
    "DuplicateIndex",
    "IndexOutOfRange",
    "IntegrityError",
    "InvalidRequest",
    "MambaSlotAllocator",
    "MisalignedIndex",
    "NotAllocated",
    "PageSlotAllocator",
    "PagedAllocator",
    "PagedState",
    "PoolUsage",
    "ReservedIndex",
    "SWAAllocator",
    "SWAState",
    "SlotAllocator",
    "SlotCopy",
    "SlotCounter",
    "TokenAllocator",
]
