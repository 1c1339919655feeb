"""kvstrata.core: what every layer shares, defined once at the bottom of the stack.

`pool` and `storage` are siblings at the bottom of the layers and may not import each other, so
what both (and the layers above) need lives here: the index and free-list error classes, the
fixed-bucket latency histogram and the host free-id list. Each member re-exports the classes
from its own `errors.py` / `metrics.py`, so callers keep importing them from the layer they use.
"""

from __future__ import annotations

from kvstrata.core.errors import (
    BufferSizeMismatch,
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    IntegrityError,
    InvalidHistogramBounds,
    LayerLoadFailed,
    MisalignedIndex,
    NotAllocated,
    ReservedIndex,
)
from kvstrata.core.free_ids import FreeIds
from kvstrata.core.histogram import HistogramSnapshot, LatencyHistogram

__all__ = [
    "BufferSizeMismatch",
    "DoubleFree",
    "DuplicateIndex",
    "FreeIds",
    "HistogramSnapshot",
    "IndexOutOfRange",
    "IntegrityError",
    "InvalidHistogramBounds",
    "LatencyHistogram",
    "LayerLoadFailed",
    "MisalignedIndex",
    "NotAllocated",
    "ReservedIndex",
]
