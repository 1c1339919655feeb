"""`TokenAllocator`: one slot at a time (page size 1).

A `PagedAllocator` with `page_size=1`: every slot is its own page, so `alloc(n)` pops n slots
off the free stack and `free` pushes them back (both one slice copy plus the page marks).
`alloc_extend` / `alloc_decode` work too and reduce to `alloc(sum of extend lengths)` /
`alloc(batch)`; `last_loc` is never read.
"""

from __future__ import annotations

import torch

from kvstrata.allocator.engine import Backend
from kvstrata.allocator.paged import PagedAllocator

__all__ = ["TokenAllocator"]


class TokenAllocator(PagedAllocator):
    """Token slots 1 .. size; slot 0 is the padding target and never handed out."""

    def __init__(
        self,
        *,
        size: int,
        device: str | torch.device = "cpu",
        sorted_reuse: bool = False,
        checked: bool = True,
        backend: Backend | None = None,
    ) -> None:
        super().__init__(
            size=size,
            page_size=1,
            device=device,
            sorted_reuse=sorted_reuse,
            checked=checked,
            backend=backend,
        )
