"""The numpy engine's decode round compiled (`decode.c`), built at first use like the pool's page
copies (`kvstrata.pool.native`: system C compiler, per-machine cache, `KVSTRATA_NATIVE=0` turns
it off, `native.disabled()` keeps new allocators off it); without it the engine runs its fused
NumPy path, which gives the same slots and raises the same errors.

Why: in a serving loop (and in `kvstrata bench alloc`) a decode round follows work that evicts
the caches, and there every NumPy or torch call costs 3-30 us instead of 1-2: the fused NumPy
path spends about 130 us on ~26 calls for 256 requests. The C round is one call for
`alloc_decode` and one for the `free` of its output; a free of whole pages (a tree's eviction)
and `check_allocated` are one call too. The C code never raises: on any input it
does not take it changes nothing and the NumPy path runs (see `decode.c`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvstrata.pool.native import native_library

SOURCE = Path(__file__).with_name("decode.c")

#: What the C functions return when they changed nothing and the NumPy path must run.
FALLBACK = -1

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class NativeDecode:
    """`kv_alloc_decode`, `kv_free_slots` and `kv_check_slots` of `decode.c`; arguments are
    raw addresses of live, correctly sized int64 / int32 arrays (the engine owns them or has
    checked them)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.alloc_decode = library.kv_alloc_decode
        self.alloc_decode.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR]
        self.alloc_decode.restype = _I64
        self.free_slots = library.kv_free_slots
        self.free_slots.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64]
        self.free_slots.restype = _I64
        self.check_slots = library.kv_check_slots
        self.check_slots.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64]
        self.check_slots.restype = _I64


def native_decode() -> NativeDecode | None:
    """The compiled decode round, or None (no compiler, turned off, inside `disabled()`)."""
    made = native_library(SOURCE)
    if made.library is None:
        return None
    try:
        return NativeDecode(made.library)
    except AttributeError:  # a library without the symbols: keep the NumPy path
        return None
