"""Exceptions a caller of `kvstrata.allocator` can see.

Every one is raised before the allocator changes anything: a call that raises leaves the free
list, the page marks, the SWA map and the counters exactly as they were.

```
AllocatorError
 +-- InvalidRequest      (also ValueError)  malformed arguments, misuse of groups or states
 +-- IndexOutOfRange     (also IndexError)  an index past the pool, or negative
 +-- ReservedIndex                          an index in page 0, the padding target
 +-- MisalignedIndex     (also ValueError)  last_loc's offset in its page contradicts the length
 +-- DuplicateIndex                         the same index twice in one call
 +-- NotAllocated                           an index whose page is free
 |    +-- DoubleFree                        ... given to a free call
 +-- IntegrityError                         check_integrity() found corrupted state
```
"""

from __future__ import annotations

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


class IndexOutOfRange(AllocatorError, IndexError):
    """An index (token slot or page id) outside `[0, num_rows)` (or `[0, num_pages)`)."""


class ReservedIndex(AllocatorError):
    """An index in page 0. Page 0 is the dummy target of padded tokens and is never handed
    out, so it can never be freed or used as a request's last slot."""


class MisalignedIndex(AllocatorError, ValueError):
    """A `last_loc` whose offset in its page is not `(prefix_len - 1) % page_size`: the slot
    cannot be the last token of a prefix of that length, so the caller's request-to-token
    table and lengths disagree."""


class DuplicateIndex(AllocatorError):
    """The same index appears twice in one call (one free, or one page list)."""


class NotAllocated(AllocatorError):
    """An index whose page is free, used where an allocated one is required (a `last_loc`
    that would be extended in place, a copy-on-write source)."""


class DoubleFree(NotAllocated):
    """A free of an index whose page is already free (or already freed in the open group)."""


class IntegrityError(AllocatorError):
    """`check_integrity()` found the allocator's own bookkeeping inconsistent: a bug in this
    package or memory corruption, never bad caller input (that raises before it lands)."""
