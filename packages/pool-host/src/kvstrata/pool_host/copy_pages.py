"""The compiled CPU copy of page rows (`copy_pages.c`, an extension module): one call moves
the rows a page plan names in every buffer of a pool, instead of a NumPy gather and scatter
per buffer.

`HostPool` builds two `RowCopy`s over its own CPU buffers (the device pool's byte rows and the
host mirror's, fixed for the pools' lives): one for backups (device -> host, every buffer) and
one for loads (host -> device, the buffers of the layers loaded), and keeps the NumPy / torch
copy (transfer.py, the same bytes) when it has none: no compiler, `KVSTRATA_NATIVE=0`, built inside
`native.disabled()`, or buffers the C code cannot take (not CPU memory, not packed byte rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.pool.native import native_extension

SOURCE = Path(__file__).with_name("copy_pages.c")
MODULE_NAME = "_kvstrata_copy_pages"


class CopyModule(Protocol):
    """The compiled module (see copy_pages.c for the contract)."""

    def copy_pages(
        self,
        table: npt.NDArray[np.int64],
        src_rows: int,
        dst_rows: int,
        src_pages: npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int64],
    ) -> int: ...


def _usable(rows: Sequence[torch.Tensor]) -> bool:
    """Byte rows of CPU memory, each row packed (what the C code reads and writes)."""
    return all(
        r.device.type == "cpu" and r.dtype == torch.uint8 and r.dim() == 2 and r.stride(1) == 1
        for r in rows
    )


def _integers(pages: object) -> bool:
    """An integer NumPy array (what converts to int64 page ids without changing a value's
    meaning; out-of-range values are then refused by the C code's range check)."""
    return isinstance(pages, np.ndarray) and pages.dtype.kind in "iu"


class RowCopy:
    """Copies row `src_pages[k]` of every buffer of `src` to row `dst_pages[k]` of the buffer
    of the same index in `dst`, in one compiled call. Holds raw addresses: both sides' buffers
    must outlive it and never move (a pool's own buffers; it keeps references to them)."""

    def __init__(
        self, module: CopyModule, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
    ) -> None:
        # The C code trusts the table: refuse here what it would read or write wrongly.
        if len(src) != len(dst) or not (_usable(src) and _usable(dst)):
            raise ValueError(
                "RowCopy takes one destination per source buffer, each 2-D uint8 CPU rows with "
                "packed columns (stride(1) == 1)"
            )
        if any(s.shape[1] != d.shape[1] for s, d in zip(src, dst, strict=True)):
            raise ValueError("RowCopy: a source and its destination rows differ in length")
        self._copy = module.copy_pages
        self._buffers = (list(src), list(dst))  # alive as long as the addresses below
        self._table = np.array(
            [
                (s.data_ptr(), s.stride(0), d.data_ptr(), d.stride(0), s.shape[1])
                for s, d in zip(src, dst, strict=True)
            ],
            dtype=np.int64,
        )
        self._all = self._table.reshape(-1)
        self._src_rows = min((r.shape[0] for r in src), default=0)
        self._dst_rows = min((r.shape[0] for r in dst), default=0)

    def __call__(
        self,
        src_pages: npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int64],
        buffers: Sequence[int] | None = None,
    ) -> bool:
        """Copy the rows of every buffer, or of the buffers at positions `buffers` (in that
        order; positions the caller took from its own buffer lists); False, having copied
        nothing, when a page id is out of range on its side or the arrays are not integer
        arrays of one shape (the caller's NumPy path then answers: it raises, or indexes as
        NumPy does). Integer arrays are made contiguous int64 when they are not."""
        table = self._all if buffers is None else self._table[list(buffers)].reshape(-1)
        try:
            got = self._copy(table, self._src_rows, self._dst_rows, src_pages, dst_pages)
        except (TypeError, ValueError, BufferError):  # a strided or non-int64 plan: convert
            if not (
                _integers(src_pages) and _integers(dst_pages) and src_pages.shape == dst_pages.shape
            ):
                return False  # float ids are never truncated, a bool array is a mask
            src = np.ascontiguousarray(src_pages, dtype=np.int64)
            dst = np.ascontiguousarray(dst_pages, dtype=np.int64)
            got = self._copy(table, self._src_rows, self._dst_rows, src, dst)
        return got >= 0


def row_copy(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> RowCopy | None:
    """The compiled copy from `src` to `dst`, or None (no compiler, turned off, inside
    `native.disabled()`, or buffers it cannot take)."""
    if len(src) != len(dst) or not (_usable(src) and _usable(dst)):
        return None
    if any(s.shape[1] != d.shape[1] for s, d in zip(src, dst, strict=True)):
        return None
    module = native_extension(SOURCE, MODULE_NAME).module
    if module is None:
        return None
    return RowCopy(cast(CopyModule, module), src, dst)
