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
element (one byte per step for uint8 bytes), about 20x slower than a memcpy, whereas NumPy's
fancy-index assignment copies each contiguous `W_g`-byte run with a strided memcpy loop. Reads
need no such detour: torch's CPU `index_select` copies whole rows. On CUDA both directions stay
in torch (`index_select`, `index_copy_`), one kernel per stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
        self._numpy_views = (
            [v.numpy() for v in self._page_views]
            if self._stacks[0].tensor.device.type == "cpu"
            else None
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

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy pages `page_ids` of every buffer into `out` ([n, page_size_bytes])."""
        for view, segment in zip(self._page_views, self._segments(out), strict=True):
            torch.index_select(view, 1, page_ids, out=segment.permute(1, 0, 2))

    def scatter(self, page_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` ([n, page_size_bytes]) into pages `page_ids` of every buffer. Ids must be
        distinct (the pool checks): duplicate scatter targets have no defined winner."""
        segments = self._segments(src)
        if self._numpy_views is not None:
            ids = page_ids.numpy()
            for array, segment in zip(self._numpy_views, segments, strict=True):
                array[:, ids] = segment.numpy().transpose(1, 0, 2)
            return
        for view, segment in zip(self._page_views, segments, strict=True):
            view.index_copy_(1, page_ids, segment.permute(1, 0, 2))


def empty_stack(
    num_buffers: int,
    num_rows: int,
    token_shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed `[num_buffers, num_rows, *token_shape]` stack. Zeroed, not empty: the dummy page
    and never-written slots then read as zeros rather than stale memory."""
    return torch.zeros((num_buffers, num_rows, *token_shape), dtype=dtype, device=device)
