"""`MambaSlotAllocator`: one recurrent-state slot per request, and copy-on-write forks.

A Mamba layer's state is one fixed-size slot per request (conv state + SSM state in the
`MambaPool`), not one per token, so this is a token allocator over slots 1 .. size (slot 0 is
the pool's padding slot). A request that starts from a cached prefix must not mutate the
cached state in place: `fork(src_slots)` allocates one fresh slot per source, all or nothing,
and returns the `(src, dst)` pairs that `MambaPool.copy(src, dst)` then copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvstrata.allocator.base import AllocatorCounters, AllocatorState, PoolUsage, SlotAllocator
from kvstrata.allocator.engine import Backend, as_index_tensor
from kvstrata.allocator.token import TokenAllocator

__all__ = ["MambaSlotAllocator", "SlotCopy"]


class SlotCopy(NamedTuple):
    """Copy the state in slot `src[i]` to slot `dst[i]` (`MambaPool.copy(src, dst)`)."""

    src: torch.Tensor
    dst: torch.Tensor


class MambaSlotAllocator(SlotAllocator):
    """State slots 1 .. size, one per request; page size 1."""

    def __init__(
        self,
        *,
        size: int,
        device: str | torch.device = "cpu",
        checked: bool = True,
        backend: Backend | None = None,
    ) -> None:
        self._slots = TokenAllocator(size=size, device=device, checked=checked, backend=backend)

    @property
    def size(self) -> int:
        return self._slots.size

    @property
    def page_size(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self._slots.device

    @property
    def counters(self) -> AllocatorCounters:
        return self._slots.counters

    def usage(self) -> list[PoolUsage]:
        return [PoolUsage("state", self.size, self._slots.available_size())]

    def available_size(self) -> int:
        return self._slots.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` state slots (one per request). See `SlotAllocator.alloc`."""
        return self._slots.alloc(need_size)

    def fork(self, src_slots: torch.Tensor) -> SlotCopy | None:
        """One new slot per slot in `src_slots` (all or nothing), paired with its source for
        the caller's copy, or None (nothing changed) when slots run out. The sources stay
        allocated and untouched; a source may appear several times (several requests forking
        one cached state). Raises `IndexOutOfRange` / `ReservedIndex` for a source outside the
        pool and, when checked, `NotAllocated` for a free one, before any change."""
        src = as_index_tensor(src_slots, "src_slots").to(device=self.device, dtype=torch.int64)
        self._slots._engine.check_allocated(src, "fork src_slots")
        dst = self._slots.alloc(len(src))
        return None if dst is None else SlotCopy(src=src, dst=dst)

    def check_allocated(self, indices: torch.Tensor, name: str = "indices") -> None:
        """`PagedAllocator.check_allocated` for state slots."""
        self._slots.check_allocated(indices, name)

    def free(self, indices: torch.Tensor) -> None:
        """Free state slots. See `SlotAllocator.free`."""
        self._slots.free(indices)

    def free_group_begin(self) -> None:
        self._slots.free_group_begin()

    def free_group_end(self) -> None:
        self._slots.free_group_end()

    def backup_state(self) -> AllocatorState:
        return self._slots.backup_state()

    def restore_state(self, state: AllocatorState) -> None:
        self._slots.restore_state(state)

    def clear(self) -> None:
        self._slots.clear()

    def check_integrity(self) -> None:
        self._slots.check_integrity()
