"""Error classes that more than one layer raises, defined once.

Each is the same class object wherever it is imported from: `kvstrata.pool.errors.DoubleFree`,
`kvstrata.allocator.errors.DoubleFree` and `kvstrata.pool_host.errors.DoubleFree` are this
module's `DoubleFree`, so one `except DoubleFree` catches a double free from any layer. Each
derives from the builtin a generic handler would catch (`IndexError`, `ValueError`,
`RuntimeError`, `AssertionError`). The message says which layer and which index; the layer that
raises one does so before it changes any state.

```
IndexError
 +-- IndexOutOfRange        a slot, page, row or host page id outside the structure
ValueError
 +-- ReservedIndex          page 0 / slot 0 / row 0: the padding target, never real data
 +-- MisalignedIndex        indices that are not whole, aligned pages, or a last slot whose
 |                          offset in its page contradicts the request's length
 +-- DuplicateIndex         the same index twice where each must appear once
 +-- NotAllocated           an index (row, slot, page) that is free where an allocated one is needed
 |    +-- DoubleFree        ... handed to a free call (or listed twice in one)
 +-- BufferSizeMismatch     a page buffer of another byte size than the page it stands for
 +-- InvalidHistogramBounds latency bucket bounds that are empty or not strictly increasing
RuntimeError
 +-- LayerLoadFailed        a layer-wise load whose producer failed before the waited layer
AssertionError
 +-- IntegrityError         check_integrity() found a structure's own bookkeeping inconsistent
```
"""

from __future__ import annotations

__all__ = [
    "BufferSizeMismatch",
    "DoubleFree",
    "DuplicateIndex",
    "IndexOutOfRange",
    "IntegrityError",
    "InvalidHistogramBounds",
    "LayerLoadFailed",
    "MisalignedIndex",
    "NotAllocated",
    "ReservedIndex",
]


class IndexOutOfRange(IndexError):
    """An index (token slot, page id, request row, host page) outside `[0, size)` of the
    structure it addresses, or negative."""


class ReservedIndex(ValueError):
    """An index in page 0 (slot 0, request row 0): the dummy target of padded tokens, never
    handed out, written with real data, freed or used as a request's last slot."""


class MisalignedIndex(ValueError):
    """Indices that do not form whole, aligned pages (page p = slots p*P .. p*P+P-1, in order),
    or a `last_loc` whose offset in its page is not `(prefix_len - 1) % page_size`."""


class DuplicateIndex(ValueError):
    """The same index twice in one call whose targets must each appear once (a free, a page
    list, a scatter destination: the result would depend on order)."""


class NotAllocated(ValueError):
    """An index whose slot, page or row is free, used where an allocated one is required."""


class DoubleFree(NotAllocated):
    """A free of an index that is already free, or listed twice in one free call."""


class BufferSizeMismatch(ValueError):
    """A buffer handed to page I/O whose byte size is not the page's (one page of the pool, or
    the stored page's size)."""


class InvalidHistogramBounds(ValueError):
    """Latency bucket bounds that are empty or not strictly increasing."""


class LayerLoadFailed(RuntimeError):
    """A layer-wise load whose producer failed before the waited layer arrived; `__cause__` is
    the producer's error."""


class IntegrityError(AssertionError):
    """`check_integrity()` found a structure's own bookkeeping inconsistent: a bug or memory
    corruption, never bad caller input (that is refused before it lands)."""
