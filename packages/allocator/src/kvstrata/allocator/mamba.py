"""`MambaSlotAllocator`: one recurrent-state slot per request, and copy-on-write forks.

A Mamba layer's state is one fixed-size slot per request (conv state + SSM state in the
`MambaPool`), not one per token, so this is a `PageSlotAllocator` of page size 1 over slots
1 .. size (slot 0 is the pool's padding slot). It is not a `TokenAllocator`: `alloc_extend` /
`alloc_decode` lay a request's tokens into pages, which means nothing for one state per
request, so it has neither. A request that starts from a cached prefix must not mutate the
cached state in place: `fork(src_slots)` allocates one fresh slot per source, all or nothing,
and returns the `(src, dst)` pairs that `MambaPool.copy(src, dst)` then copies.
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import torch

from kvstrata.allocator.base import PoolUsage
from kvstrata.allocator.engine import as_index_tensor
from kvstrata.allocator.paged import PagedOptions, PageSlotAllocator

__all__ = ["MambaSlotAllocator", "SlotCopy"]


class SlotCopy(NamedTuple):
    """Copy the state in slot `src[i]` to slot `dst[i]` (`MambaPool.copy(src, dst)`)."""

    src: torch.Tensor
    dst: torch.Tensor


class MambaSlotAllocator(PageSlotAllocator):
    """State slots 1 .. size, one per request; page size 1. Its usage names the pool "state";
    it can `fork` slots. Takes the options of `PageSlotAllocator` (`device`, `sorted_reuse`,
    `checked`, `backend`)."""

    def __init__(self, *, size: int, **options: Unpack[PagedOptions]) -> None:
        super().__init__(size=size, page_size=1, **options)

    def usage(self) -> list[PoolUsage]:
        return [PoolUsage("state", self.size, self.available_size())]

    def fork(self, src_slots: torch.Tensor) -> SlotCopy | None:
        """One new slot per slot in `src_slots` (all or nothing), paired with its source for
        the caller's copy, or None (nothing changed) when slots run out. The sources stay
        allocated and untouched; a source may appear several times (several requests forking
        one cached state). Raises `IndexOutOfRange` / `ReservedIndex` for a source outside the
        pool and, when checked, `NotAllocated` for a free one, before any change."""
        src = as_index_tensor(src_slots, "src_slots").to(device=self.device, dtype=torch.int64)
        self._engine.check_allocated(src, "fork src_slots")
        dst = self.alloc(len(src))
        return None if dst is None else SlotCopy(src=src, dst=dst)
