"""Exceptions a caller of `kvstrata.allocator` can see.

Every one is raised before the allocator changes anything: a call that raises leaves the free
list, the page marks, the SWA map and the counters exactly as they were.

```
AllocatorError
 +-- InvalidRequest      (also ValueError)  malformed arguments, misuse of groups or states

shared with the other layers (one class each, defined in kvstrata.core.errors, re-exported here):
IndexOutOfRange          (an IndexError)    an index past the pool, or negative
ReservedIndex            (a ValueError)     an index in page 0, the padding target
MisalignedIndex          (a ValueError)     last_loc's offset in its page contradicts the length
DuplicateIndex           (a ValueError)     the same index twice in one call
NotAllocated             (a ValueError)     an index whose page is free
 +-- DoubleFree                             ... given to a free call
IntegrityError           (an AssertionError) check_integrity() found corrupted state
```

The shared classes are not `AllocatorError`s: `except DoubleFree` (imported from here, from
`kvstrata.pool` or `kvstrata.pool_host`) catches a double free of any layer.
"""

from __future__ import annotations

from kvstrata.core.errors import (
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    IntegrityError,
    MisalignedIndex,
    NotAllocated,
    ReservedIndex,
)

__all__ = [
    "AllocatorError",
    "DoubleFree",
    "DuplicateIndex",
    "IndexOutOfRange",
    "IntegrityError",
    "InvalidRequest",
    "MisalignedIndex",
    "NotAllocated",
    "ReservedIndex",
]


class AllocatorError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequest(AllocatorError, ValueError):
    """Arguments that cannot describe a valid request: a negative size, a size that is not whole
    pages, tensors of different lengths, `seq_lens < prefix_lens`, a `last_loc` missing where a
    request needs it, an unbalanced free group, or a state from another allocator."""
