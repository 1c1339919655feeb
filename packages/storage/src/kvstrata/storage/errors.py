"""Caller-visible errors of kvstrata.storage.

Every one of them is raised before the call changes anything: no page written, removed or
touched, no caller buffer filled. Failures of one page inside a batch (disk full, an I/O error, a
corrupt file) are not exceptions: they are `False` for that page in the batch result.

`BufferSizeMismatch` is the class of `kvstrata.core.errors` (the host tier raises it too),
re-exported here; it is a `ValueError`, not a `StorageError`.
"""

from __future__ import annotations

from kvstrata.core.errors import BufferSizeMismatch

__all__ = [
    "BackendAlreadyRegistered",
    "BatchLengthMismatch",
    "BufferSizeMismatch",
    "InvalidBuffer",
    "InvalidKey",
    "InvalidParameter",
    "InvalidStorageURL",
    "StorageDirectoryError",
    "StorageError",
    "UnknownBackend",
]


class StorageError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidParameter(StorageError, ValueError):
    """A constructor or call argument is out of range or of the wrong kind
    (negative capacity, unknown fsync policy or hash, page size < 1, non-integer token ids)."""


class InvalidKey(StorageError, ValueError):
    """A page key is not non-empty `bytes`, or is too long for the backend."""


class InvalidBuffer(StorageError, TypeError):
    """A page buffer does not expose contiguous CPU bytes, or is read-only where the call
    writes into it."""


class BatchLengthMismatch(StorageError, ValueError):
    """`keys` and `buffers` of one batch call have different lengths."""


class StorageDirectoryError(StorageError, OSError):
    """The directory of a FileStorage is missing, not a directory, or not writable."""


class InvalidStorageURL(InvalidParameter):
    """`open_storage` could not parse the URL or one of its parameters."""


class UnknownBackend(InvalidStorageURL):
    """No backend is registered for the URL's scheme."""


class BackendAlreadyRegistered(StorageError, ValueError):
    """`register_backend` was called twice for one scheme without `replace=True`."""
