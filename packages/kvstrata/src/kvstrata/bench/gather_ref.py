"""Reference gathers for `kvstrata bench pageio`: NumPy's own gather of the same pieces.

A page set at page size 1 is, for a layer-first pool, thousands of small pieces (one per page
and buffer) at random addresses. Beside its plain copy the page I/O benchmark times one
`numpy.take` (read) / `numpy.put` (write) of exactly the same W-byte pieces from the same pool
memory into the same buffer: the best a single NumPy call does here, and so the ceiling of the
pools' NumPy fallback (`KVSTRATA_NATIVE=0`). The compiled path (`kvstrata.pool.native`) is set
beside it. Not used by the pools.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt


def reference_ops(
    pool_bytes: npt.NDArray[np.uint8],
    flat: npt.NDArray[np.uint8],
    pieces: npt.NDArray[np.int64],
    width: int,
) -> dict[str, Callable[[], None]]:
    """`numpy_take` (pieces of `pool_bytes` -> `flat`) and `numpy_put` (back), pieces numbered
    in `pool_bytes` seen as `width`-byte items, `flat` contiguous with len(pieces) items. The
    arrays must outlive the returned callables."""
    item = np.dtype((np.void, width))
    src_items = pool_bytes.reshape(-1).view(item)
    flat_items = flat.reshape(-1).view(item)

    def numpy_take() -> None:
        np.take(src_items, pieces, out=flat_items, mode="clip")

    def numpy_put() -> None:
        np.put(src_items, pieces, flat_items, mode="clip")

    return {"numpy_take": numpy_take, "numpy_put": numpy_put}
