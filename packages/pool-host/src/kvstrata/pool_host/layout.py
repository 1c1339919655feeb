"""Host layouts: where the page bytes of each mirrored device buffer sit in a host region.

B buffers (the device pool's `layer_buffers()`, in order), P = page size, `bytes(b)` = the bytes
of P tokens of buffer b. The flat page format (the device pool's read_pages / write_pages) is
`bytes(b0) | bytes(b1) | ... | bytes(bB-1)`; `BufferGeometry.page_offset` is where b starts in it.

    layer_first        per buffer a contiguous chunk [host_pages, bytes(b)] (64-byte aligned):
                       a layer's pages are contiguous, a page is B pieces.
    page_first         one [host_pages, page_size_bytes] block: page p is the flat page, one
    page_first_direct  contiguous range; buffer b's rows are the strided column slice
                       [:, offset_b : offset_b + bytes(b)]. (The two differ only in how a backup
                       fills them: see HostPool.)

Every layout is carved out of one region from a HostTensorAllocator, so a pool is a single
allocation (one pin registration, one shared-memory name).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

import torch

from kvstrata.pool_host.memory import HostRegion, HostTensorAllocator

#: Buffer chunks of a layer_first region start on this boundary (cache line; lets typed views
#: of every dtype sit on their natural alignment).
CHUNK_ALIGN = 64


class HostLayout(StrEnum):
    layer_first = "layer_first"
    page_first = "page_first"
    page_first_direct = "page_first_direct"


class BufferGeometry(NamedTuple):
    """One mirrored buffer: per-token shape and dtype, bytes per token and per page, and the
    buffer's byte offset inside a flat page."""

    token_shape: tuple[int, ...]
    dtype: torch.dtype
    token_bytes: int
    page_bytes: int
    page_offset: int


def buffer_geometry(buffers: Sequence[torch.Tensor], page_size: int) -> tuple[BufferGeometry, ...]:
    """Geometry of each buffer, offsets laid side by side in the given (flat page) order."""
    out: list[BufferGeometry] = []
    offset = 0
    for b in buffers:
        token_bytes = b[0].numel() * b.element_size()
        out.append(
            BufferGeometry(
                tuple(b.shape[1:]), b.dtype, token_bytes, token_bytes * page_size, offset
            )
        )
        offset += token_bytes * page_size
    return tuple(out)


class HostRows(NamedTuple):
    """A host pool's memory: the region, per buffer its bytes as `[num_pages, page_bytes]` rows
    (strided in page_first layouts), and for page_first layouts the `[num_pages,
    page_size_bytes]` block of whole flat pages (None for layer_first)."""

    region: HostRegion
    rows: list[torch.Tensor]
    pages: torch.Tensor | None


def lay_out(
    layout: HostLayout,
    geometry: Sequence[BufferGeometry],
    num_pages: int,
    allocator: HostTensorAllocator,
) -> HostRows:
    """Allocate one region for `num_pages` host pages in `layout` and carve it into rows.
    The allocator refuses (InsufficientHostMemory) before allocating a region too large."""
    if layout is HostLayout.layer_first:
        starts: list[int] = []
        total = 0
        for g in geometry:
            starts.append(total)
            total += -(-num_pages * g.page_bytes // CHUNK_ALIGN) * CHUNK_ALIGN  # round up
        region = allocator.allocate(total)
        rows = [
            region.tensor[s : s + num_pages * g.page_bytes].view(num_pages, g.page_bytes)
            for s, g in zip(starts, geometry, strict=True)
        ]
        return HostRows(region, rows, None)
    page_size_bytes = sum(g.page_bytes for g in geometry)
    region = allocator.allocate(num_pages * page_size_bytes)
    pages = region.tensor.view(num_pages, page_size_bytes)
    rows = [pages[:, g.page_offset : g.page_offset + g.page_bytes] for g in geometry]
    return HostRows(region, rows, pages)
