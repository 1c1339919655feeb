"""Reference gathers for `kvstrata bench pageio`: how fast any code moves the same pieces.

A page set at page size 1 is, for a layer-first pool, thousands of small pieces (one per page
and buffer) at random addresses. To tell the cost of our code from the cost of the memory
system, the page I/O benchmark times two raw gathers of exactly the same pieces, from the same
pool memory, into the same buffer, beside its plain copy:

- `numpy_take`: one `numpy.take` of W-byte items (what NumPy can do in one call);
- `compiled`: a C loop of `memcpy` per piece with software prefetch of the pieces `PREFETCH_AHEAD`
  positions later (what a hand-written kernel does about the latency of each piece), compiled
  at run time with the system C compiler (`cc`, `-O3`); absent when there is none.

Neither is used by the pools: they only bound what an implementation could reach here.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

#: Pieces ahead whose cache lines the compiled gather prefetches (best of 0-32 measured here).
PREFETCH_AHEAD = 8

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
void gather(uint8_t *restrict out, const uint8_t *restrict src, const int64_t *restrict idx,
            int64_t n, int64_t w, int64_t ahead) {
  for (int64_t k = 0; k < n; k++) {
    if (k + ahead < n) {
      const uint8_t *p = src + idx[k + ahead] * w;
      for (int64_t o = 0; o < w; o += 64) __builtin_prefetch(p + o, 0, 3);
    }
    memcpy(out + k * w, src + idx[k] * w, w);
  }
}
void scatter(uint8_t *restrict dst, const uint8_t *restrict in, const int64_t *restrict idx,
             int64_t n, int64_t w, int64_t ahead) {
  for (int64_t k = 0; k < n; k++) {
    if (k + ahead < n) {
      uint8_t *p = dst + idx[k + ahead] * w;
      for (int64_t o = 0; o < w; o += 64) __builtin_prefetch(p + o, 1, 3);
    }
    memcpy(dst + idx[k] * w, in + k * w, w);
  }
}
"""

_library: ctypes.CDLL | None = None
_tried = False


def compiled_library() -> ctypes.CDLL | None:
    """The reference C gather, compiled once per process; None without a C compiler or when
    compiling fails (the benchmark then reports no compiled figure)."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kvstrata-gather-") as folder:
        source, shared = Path(folder) / "gather.c", Path(folder) / "gather.so"
        source.write_text(_SOURCE)
        result = subprocess.run(
            [cc, "-O3", "-shared", "-fPIC", "-o", str(shared), str(source)],
            capture_output=True,
            check=False,
        )
        if result.returncode == 0:
            # Loaded before the folder goes: the mapping outlives the file.
            _library = ctypes.CDLL(str(shared))
    return _library


def reference_ops(
    pool_bytes: npt.NDArray[np.uint8],
    flat: npt.NDArray[np.uint8],
    pieces: npt.NDArray[np.int64],
    width: int,
) -> dict[str, Callable[[], None]]:
    """Raw gathers and scatters of pieces `pieces` (W = `width` bytes each, numbered in
    `pool_bytes` seen as W-byte items) to and from `flat` (contiguous, len(pieces) * W bytes),
    keyed `numpy_take`, `numpy_put` and, with a compiler, `compiled_gather`,
    `compiled_scatter`. The arrays must outlive the returned callables."""
    item = np.dtype((np.void, width))
    src_items = pool_bytes.reshape(-1).view(item)
    flat_items = flat.reshape(-1).view(item)

    def numpy_take() -> None:
        np.take(src_items, pieces, out=flat_items, mode="clip")

    def numpy_put() -> None:
        np.put(src_items, pieces, flat_items, mode="clip")

    ops: dict[str, Callable[[], None]] = {"numpy_take": numpy_take, "numpy_put": numpy_put}
    lib = compiled_library()
    if lib is not None:
        out_p = ctypes.c_void_p(flat.ctypes.data)
        src_p = ctypes.c_void_p(pool_bytes.ctypes.data)
        idx_p = ctypes.c_void_p(pieces.ctypes.data)
        n, w, ahead = (ctypes.c_int64(v) for v in (len(pieces), width, PREFETCH_AHEAD))

        def compiled_gather() -> None:
            lib.gather(out_p, src_p, idx_p, n, w, ahead)

        def compiled_scatter() -> None:
            lib.scatter(src_p, out_p, idx_p, n, w, ahead)

        ops["compiled_gather"] = compiled_gather
        ops["compiled_scatter"] = compiled_scatter
    return ops
