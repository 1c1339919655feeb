"""Flat-page gather and scatter over a pool's stacked layer buffers.

A pool allocates its per-layer buffers as a few *stacks* (MHA: one tensor for every layer's K
and V, or one for K and one for V when their widths differ; MLA: one; Mamba: conv states and
SSM states), each `[num_buffers, num_rows, ...]` and contiguous. Seen as bytes, stack g is
`[B_g, num_pages, W_g]` with `W_g` the bytes of one page of one buffer, so the pages of a set of
ids are one `index_select` along dim 1.

The flat page (what read_pages / write_pages move) holds every buffer's page bytes in
`layer_buffers()` order. Stack g's buffer b sits at byte `offset_g + b * stride_g`:

    MHA   | K0 | K1 | ... | K(L-1) | V0 | ... | V(L-1) |   K: offset 0, stride Wk
                                                          V: offset L*Wk, stride Wv
                                                          (K and V one stack when Wk == Wv)
    Mamba | conv0 | ssm0 | conv1 | ssm1 | ...          |   conv: offset 0, stride Wc+Ws
                                                          ssm:  offset Wc, stride Wc+Ws

so the slice of a caller's `[n, page_size_bytes]` buffer that belongs to stack g is the strided
view `[n, B_g, W_g]` (strides `(row, stride_g, 1)`), and one call per stack moves every page:

    read:  index_select(stack_g, dim 1, ids, out=view_g.permute(1, 0, 2))
    write: stack_g[:, ids] = view_g.permute(1, 0, 2)

Why NumPy for the CPU write: torch's CPU `index_copy_` / `index_put_` walk the tensor element by
element (one byte per step for uint8 bytes), about 20x slower than a memcpy. NumPy moves whole
runs. On CUDA both directions stay in torch (`index_select`, `index_copy_`), one kernel per stack.

The one-piece path (CPU, one stack, caller buffer contiguous). Then the flat buffer is exactly
the pieces `(page i, buffer b)` in i-major order, so seen as one `W`-byte item per piece
(a NumPy `void` dtype of W bytes) both the buffer and the stack are 1-D arrays of pieces, and a
page set is one flat list of piece numbers `b * num_pages + ids[i]`:

    read:  numpy.take(stack_items, pieces, out=buffer_items)      one memmove of W per piece
    write: numpy.put(stack_items, pieces, buffer_items)           one memmove of W per piece

with no per-call strided iterator and no transposed temporary: at page size 1 (MHA, 512-byte
pieces, 56 per page) the write went from 0.35 to 0.46 of a contiguous copy in an A/B run under
load (0.6 on a quieter machine). Reads of small pieces keep `index_select` (as fast there,
measured); see `ONE_PIECE_READ_MIN_BYTES`.

The compiled path (CPU, any layout, any caller row stride): when `native.native_copies()` is
available (a C compiler on the machine; see `native.py`), both directions run `page_copy.c`,
one call per stack over every (page, buffer) piece, with software prefetch and, for calls of
`native.STREAM_MIN_BYTES` and more, non-temporal stores. The NumPy / torch paths above are the
fallback and give the same bytes.

Huge pages (CPU). A page set touches `num_buffers` pieces per page, each in a different 4 KiB
page of memory, so a scattered copy of small pieces pays TLB misses on top of cache misses:
with the stack on 2 MiB pages (`madvise(MADV_HUGEPAGE)`, see `empty_stack`) reads at page size
16 went from 0.75 to 0.85 of a contiguous copy in the same A/B run. Memory that the kernel
cannot back with huge pages stays on 4 KiB pages: only speed changes.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.pool.native import STREAM_MIN_BYTES, STREAM_MODE, native_copies

#: A (transparent) huge page on x86-64 Linux: huge-page stacks start at a multiple of it.
HUGE_PAGE_BYTES = 2 << 20

#: CPU stacks of at least this many bytes go on huge-page memory (smaller ones would waste
#: most of a huge page and gain nothing).
HUGE_PAGE_MIN_STACK_BYTES = HUGE_PAGE_BYTES

#: CPU reads take the one-piece path (numpy.take) only when a piece has at least this many
#: bytes; below it torch's `index_select` over the stacked view is as fast.
ONE_PIECE_READ_MIN_BYTES = 4096


@dataclass(frozen=True, kw_only=True, eq=False)
class BufferStack:
    """Layer buffers allocated as one tensor, and where they sit in a flat page.

    `tensor` is `[num_buffers, num_rows, ...]`, contiguous; buffer b is `tensor[b]`.
    Its page bytes lie at `page_offset + b * page_stride` in a flat page.
    """

    tensor: torch.Tensor
    page_offset: int
    page_stride: int


class PageLayout:
    """The flat page format of one pool and the copies in and out of it.

    Holds views of the pool's stacks (no copies), so it lives as long as the pool. `gather` and
    `scatter` take ids already validated (int64, on the pool's device, in range) and a caller
    buffer already checked (uint8, `[n, page_size_bytes]`, on the pool's device, inner stride
    1): the pool validates, this class only copies.
    """

    def __init__(self, stacks: Sequence[BufferStack], *, num_rows: int, page_size: int) -> None:
        assert stacks, "a pool has at least one buffer stack"
        assert num_rows % page_size == 0, f"num_rows {num_rows} is not whole pages of {page_size}"
        self.num_pages = num_rows // page_size
        self._stacks = tuple(stacks)
        self._page_views: list[torch.Tensor] = []
        self._widths: list[int] = []
        placed: list[tuple[int, int, torch.Tensor]] = []
        for s in self._stacks:
            t = s.tensor
            assert t.is_contiguous(), "a buffer stack must be contiguous"
            assert t.shape[1] == num_rows, f"stack has {t.shape[1]} rows, the pool {num_rows}"
            row_bytes = t[0, 0].numel() * t.element_size()
            width = row_bytes * page_size
            # Bytes of page p of buffer b are view[b, p]: a reinterpretation, no copy.
            self._page_views.append(t.view(torch.uint8).view(t.shape[0], self.num_pages, width))
            self._widths.append(width)
            placed.extend(
                (s.page_offset + b * s.page_stride, width, t[b]) for b in range(t.shape[0])
            )
        placed.sort(key=lambda p: p[0])
        # The buffers must tile the flat page exactly: no gap, no overlap.
        cursor = 0
        for offset, width, _ in placed:
            assert offset == cursor, f"flat page has a gap or overlap at byte {cursor}"
            cursor += width
        self.page_size_bytes = cursor
        self.buffers: tuple[torch.Tensor, ...] = tuple(buf for _, _, buf in placed)
        cpu = self._stacks[0].tensor.device.type == "cpu"
        self._numpy_views = [v.numpy() for v in self._page_views] if cpu else None
        self._native = native_copies() if cpu else None
        # Per stack, the C copies' fixed arguments: address, pages, piece width, buffers,
        # and where its pieces sit in a flat page (offset, stride).
        self._native_stacks = [
            (
                s.tensor.data_ptr(),
                self.num_pages,
                w,
                s.tensor.shape[0],
                s.page_offset,
                s.page_stride,
            )
            for s, w in zip(self._stacks, self._widths, strict=True)
        ]
        # The one-piece path needs the flat page to be one stack's pieces in buffer order.
        self._pieces: _Pieces | None = None
        if cpu and len(self._stacks) == 1:
            only, width = self._stacks[0], self._widths[0]
            assert only.page_offset == 0 and only.page_stride == width, "one stack tiles a page"
            buffers = only.tensor.shape[0]
            self._pieces = _Pieces(
                item=np.dtype((np.void, width)),
                stack=_as_items(self._page_views[0].numpy(), width),
                first=np.arange(buffers, dtype=np.int64) * self.num_pages,
                read=width >= ONE_PIECE_READ_MIN_BYTES,
            )

    @property
    def num_bytes(self) -> int:
        """Bytes held by every stack (the dummy page included)."""
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self._stacks)

    def stack_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(s.tensor for s in self._stacks)

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per stack, the `[n, B_g, W_g]` strided view of `flat` ([n, page_size_bytes])."""
        n = flat.shape[0]
        return [
            flat.as_strided(
                (n, s.tensor.shape[0], width),
                (flat.stride(0), s.page_stride, 1),
                flat.storage_offset() + s.page_offset,
            )
            for s, width in zip(self._stacks, self._widths, strict=True)
        ]

    def _piece_ids(self, pieces: _Pieces, page_ids: torch.Tensor) -> npt.NDArray[np.int64]:
        """Piece numbers of pages `page_ids`, page-major: `b * num_pages + ids[i]` at
        `i * num_buffers + b`, the order the pieces have in a flat buffer."""
        return (page_ids.numpy()[:, None] + pieces.first).reshape(-1)

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy pages `page_ids` of every buffer into `out` ([n, page_size_bytes])."""
        if self._native is not None:
            self._native_copy(page_ids, out, gather=True)
            return
        pieces = self._pieces
        if pieces is not None and pieces.read and out.is_contiguous():
            # mode="clip": the pool validated the ids, and "raise" would buffer the output.
            np.take(
                pieces.stack,
                self._piece_ids(pieces, page_ids),
                out=_as_items(out.numpy(), pieces.item.itemsize),
                mode="clip",
            )
            return
        for view, segment in zip(self._page_views, self._segments(out), strict=True):
            torch.index_select(view, 1, page_ids, out=segment.permute(1, 0, 2))

    def scatter(self, page_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` ([n, page_size_bytes]) into pages `page_ids` of every buffer. Ids must be
        distinct (the pool checks): duplicate scatter targets have no defined winner."""
        if self._native is not None:
            self._native_copy(page_ids, src, gather=False)
            return
        pieces = self._pieces
        if pieces is not None and src.is_contiguous():
            np.put(
                pieces.stack,
                self._piece_ids(pieces, page_ids),
                _as_items(src.numpy(), pieces.item.itemsize),
                mode="clip",
            )
            return
        segments = self._segments(src)
        if self._numpy_views is not None:
            ids = page_ids.numpy()
            for array, segment in zip(self._numpy_views, segments, strict=True):
                array[:, ids] = segment.numpy().transpose(1, 0, 2)
            return
        for view, segment in zip(self._page_views, segments, strict=True):
            view.index_copy_(1, page_ids, segment.permute(1, 0, 2))

    @property
    def native(self) -> bool:
        """Whether page copies run the compiled path (see the module docstring)."""
        return self._native is not None

    def copy_checked(
        self, page_ids: torch.Tensor, flat: torch.Tensor, *, gather: bool, allow_zero: bool
    ) -> bool:
        """`gather` / `scatter` through `page_copy.c`, the page ids checked in C first (range,
        page 0 unless `allow_zero`, and for a scatter no repeats). False, with nothing moved,
        when the check refuses them. Needs the compiled copies, plain int64 ids and a valid
        CPU buffer (the pool has checked it)."""
        return self._native_copy(page_ids, flat, gather=gather, check=True, allow_zero=allow_zero)

    def _native_copy(
        self,
        page_ids: torch.Tensor,
        flat: torch.Tensor,
        *,
        gather: bool,
        check: bool = False,
        allow_zero: bool = True,
    ) -> bool:
        """One C call per stack; with `check` the first one checks the ids before copying.
        `flat` is a CPU uint8 [n, page_size_bytes] with inner stride 1 (any row stride)."""
        native = self._native
        assert native is not None, "_native_copy without the compiled copies"
        ids = page_ids.contiguous()  # kept alive across the calls: they read its memory
        n = ids.shape[0]
        stream = STREAM_MODE if n * self.page_size_bytes >= STREAM_MIN_BYTES else 0
        ids_at, flat_at, row = ids.data_ptr(), flat.data_ptr(), flat.stride(0)
        first, scatter = check, not gather
        for at, num_pages, width, buffers, offset, stride in self._native_stacks:
            refused = native.copy(
                at, num_pages, width, buffers, flat_at, row, offset, stride, ids_at, n, stream,
                first, allow_zero, scatter,
            )  # fmt: skip
            if refused:
                assert first, "the C copies refused ids they were not asked to check"
                return False
            first = False
        return True


@dataclass(frozen=True, kw_only=True, eq=False)
class _Pieces:
    """A one-stack layout seen as pieces (one buffer's bytes of one page) for NumPy."""

    item: np.dtype[np.void]  # one piece: W opaque bytes
    stack: npt.NDArray[np.void]  # [num_buffers * num_pages], piece b * num_pages + p
    first: npt.NDArray[np.int64]  # [num_buffers]: b * num_pages, buffer b's first piece
    read: bool  # whether gather takes this path too (pieces large enough)


def _as_items(array: npt.NDArray[np.uint8], width: int) -> npt.NDArray[np.void]:
    """A C-contiguous uint8 array whose size is a multiple of `width`, as 1-D `width`-byte
    items (a view: writes go through)."""
    items = array.reshape(-1).view(np.dtype((np.void, width)))
    # reshape copies when it cannot view; a copy here would drop a read's bytes silently.
    assert np.may_share_memory(items, array), "a contiguous array reshaped to a copy"
    return items


def empty_stack(
    num_buffers: int,
    num_rows: int,
    token_shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed `[num_buffers, num_rows, *token_shape]` stack. Zeroed, not empty: the dummy page
    and never-written slots then read as zeros rather than stale memory.

    On the CPU a stack of at least HUGE_PAGE_MIN_STACK_BYTES is placed on memory advised for
    transparent huge pages (see the module docstring), faulted in here so that the pool's
    memory is committed at construction as with torch.zeros."""
    shape = (num_buffers, num_rows, *token_shape)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = num_buffers * num_rows
    for d in token_shape:
        numel *= d
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    if num_bytes < HUGE_PAGE_MIN_STACK_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_zeros(num_bytes).view(dtype).view(shape)


def huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """`num_bytes` zeroed uint8 bytes on an anonymous mapping advised MADV_HUGEPAGE, starting at
    a 2 MiB boundary (the kernel backs only aligned 2 MiB runs with huge pages). The tensor
    keeps the mapping alive (torch.frombuffer holds the buffer) and the mapping is unmapped
    when the last view of it is dropped. Linux only (mmap.MADV_HUGEPAGE)."""
    mapping = mmap.mmap(
        -1,
        num_bytes + HUGE_PAGE_BYTES,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    region = whole[start : start + num_bytes]
    # An anonymous mapping reads as zeros already; writing them faults every page in now.
    region.zero_()
    return region
