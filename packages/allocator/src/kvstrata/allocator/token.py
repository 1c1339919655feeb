"""`TokenAllocator`: one slot at a time (page size 1).

A `PagedAllocator` with `page_size=1`: every slot is its own page, so `alloc(n)` pops n slots
off the free stack and `free` pushes them back (both one slice copy plus the page marks).
`alloc_extend` / `alloc_decode` work too and reduce to `alloc(sum of extend lengths)` /
`alloc(batch)`; `last_loc` is never read.
"""

from __future__ import annotations

from typing import Unpack

from kvstrata.allocator.paged import PagedAllocator, PagedOptions

__all__ = ["TokenAllocator"]


class TokenAllocator(PagedAllocator):
    """Token slots 1 .. size; slot 0 is the padding target and never handed out. Takes the
    options of `PagedAllocator` (`device`, `sorted_reuse`, `checked`, `backend`)."""

    def __init__(self, *, size: int, **options: Unpack[PagedOptions]) -> None:
        super().__init__(size=size, page_size=1, **options)
