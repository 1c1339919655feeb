"""The slot allocator contract every family implements, and the small records it hands out.

A slot allocator answers one question: which device slots are free. It never evicts (that is
the radix cache's job) and never touches the bytes in the slots (that is the pool's job).

Slot numbering, shared with `kvstrata.pool`:

```
 row:   0 .. P-1 | P .. 2P-1 | 2P .. 3P-1 | ... | size .. size+P-1
 page:     0     |     1     |     2      | ... |    num_pages-1
           ^ reserved: padded tokens write here; never handed out, never freed
```
`size` counts usable slots (page 0 excluded); the pool has `size + page_size` rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from kvstrata.allocator.errors import InvalidRequest

__all__ = ["AllocatorCounters", "AllocatorState", "PoolUsage", "SlotAllocator"]


@dataclass(slots=True)
class AllocatorCounters:
    """Cumulative event counters, read by `AllocatorCollector` at scrape time.

    Plain integers: the hot path pays one attribute add per event. They survive `clear()` and
    `restore_state()` (they count what happened, not what is held).
    """

    alloc_calls: int = 0
    failed_allocs: int = 0
    allocated_slots: int = 0
    free_calls: int = 0
    freed_slots: int = 0


class PoolUsage(NamedTuple):
    """Occupancy of one slot pool behind an allocator (an SWA allocator has two)."""

    pool: str
    capacity_slots: int
    available_slots: int

    @property
    def used_slots(self) -> int:
        return self.capacity_slots - self.available_slots


@dataclass(frozen=True, kw_only=True)
class AllocatorState:
    """An opaque snapshot from `backup_state()`, valid only for the allocator that made it.

    `owner` identifies that allocator; each family subclasses this with its own payload.
    """

    owner: object


StateT = TypeVar("StateT", bound=AllocatorState)


class SlotAllocator(ABC):
    """Hands out free device slots as int64 index tensors on `device`.

    Validity of returned indices: an index is the caller's from the `alloc*` call that returned
    it until the caller frees it (or until `clear()`, or a `restore_state()` to a snapshot taken
    before it was handed out). The allocator never takes an index back on its own.

    This base keeps what every family shares: its description (`size`, `page_size`, `device`),
    its counters, the identity its states carry, and the check that an `alloc` size is whole
    pages.
    """

    def __init__(self, *, size: int, page_size: int, device: str | torch.device) -> None:
        self._size = size
        self._page_size = page_size
        self._device = torch.device(device)
        self._counters = AllocatorCounters()
        self._owner = object()

    @property
    def size(self) -> int:
        """Usable slots (page 0 excluded)."""
        return self._size

    @property
    def page_size(self) -> int:
        """Slots per page; indices are handed out and freed in whole pages."""
        return self._page_size

    @property
    def device(self) -> torch.device:
        """Device of every index tensor this allocator returns."""
        return self._device

    @property
    def counters(self) -> AllocatorCounters:
        """Live counters (the object itself, not a copy)."""
        return self._counters

    def _pages_for(self, need_size: int) -> int:
        """The whole pages `alloc(need_size)` takes; `InvalidRequest` for a negative size or
        one that is not whole pages."""
        size = self._page_size
        if need_size < 0 or need_size % size:
            raise InvalidRequest(f"alloc({need_size}): need a non-negative multiple of {size}")
        return need_size // size

    def _fail(self) -> None:
        """Count a failed allocation; returns None, which is what the failed `alloc*` returns."""
        self._counters.alloc_calls += 1
        self._counters.failed_allocs += 1

    def _own_state(self, state: AllocatorState, kind: type[StateT]) -> StateT:
        """`state` as this allocator's `kind`; `InvalidRequest` when another allocator (or
        another family) made it."""
        if not isinstance(state, kind) or state.owner is not self._owner:
            raise InvalidRequest("restore_state: the state was not made by this allocator")
        return state

    @abstractmethod
    def usage(self) -> list[PoolUsage]:
        """Capacity and availability of each pool this allocator manages. O(1)."""

    @abstractmethod
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` free slots (a multiple of `page_size`), or None when there are not
        enough. Never evicts; on None nothing changed. `alloc(0)` returns an empty tensor.

        Mutates: the free list (and the page marks). Raises `InvalidRequest` for a
        negative size or one that is not whole pages.
        """

    @abstractmethod
    def free(self, indices: torch.Tensor) -> None:
        """Return the pages that `indices` (any shape, any integer dtype) touch.

        Inside a free group the pages are checked and marked free now but become available at
        `free_group_end()`. An empty tensor is a no-op. Raises, before changing anything,
        `IndexOutOfRange`, `ReservedIndex`, `DuplicateIndex` or `DoubleFree`.
        """

    @abstractmethod
    def available_size(self) -> int:
        """Slots an `alloc` could hand out now (frees pending in an open group excluded)."""

    @abstractmethod
    def free_group_begin(self) -> None:
        """Start batching frees: each later `free` is checked at once, and all of them become
        available together at `free_group_end()`. Raises `InvalidRequest` if a group is open."""

    @abstractmethod
    def free_group_end(self) -> None:
        """Make every free since `free_group_begin()` available in one step. Raises
        `InvalidRequest` if no group is open."""

    @abstractmethod
    def backup_state(self) -> AllocatorState:
        """Snapshot the free list for a later `restore_state`. Costs a copy of the free list.
        Raises `InvalidRequest` inside a free group (pending frees have no place in it)."""

    @abstractmethod
    def restore_state(self, state: AllocatorState) -> None:
        """Roll back to `state`: indices handed out since the snapshot become free again (the
        caller must drop them) and indices freed since it become allocated again. Counters are
        not rolled back. Raises `InvalidRequest` for a state of another allocator or inside a
        free group."""

    @abstractmethod
    def clear(self) -> None:
        """Free everything (closing any open free group). Indices held by callers are void."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Verify the bookkeeping: no page both free and handed out, none lost, none listed
        twice, free + used == capacity, page 0 never free. Raises `IntegrityError`. Costs a
        pass over the whole free list (O(num_pages)); meant for tests and debugging."""
