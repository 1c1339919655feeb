"""Caller-visible errors of kvstrata.l3_store.

Each is raised before the call changes anything. Failures of a store at run time (a dead or
slow actor, a page that fails its checksum) are not exceptions on the engine side: they are
misses and dropped writes, counted in the client's stats.
"""

from __future__ import annotations

from kvstrata.storage.errors import InvalidParameter, StorageError


class L3StoreError(StorageError):
    """Base of every error this package raises on purpose."""


class InvalidStoreConfig(L3StoreError, InvalidParameter):
    """A store or client setting is out of range (budget < 1 page of alignment, watermarks
    not 0 < low <= high <= 1, a timeout <= 0, a namespace with characters a name cannot hold)."""


class UnknownLease(L3StoreError, KeyError):
    """`release` was handed a lease id the store never granted or already released."""


class UnknownReservation(L3StoreError, KeyError):
    """`commit` was handed a reservation id the store never granted, already committed, or
    let expire."""


class ArenaMismatch(L3StoreError, ValueError):
    """A client mapped an arena file whose size or identity differs from what its store says
    (the store was replaced since the client looked)."""


class RayNotConnected(L3StoreError, RuntimeError):
    """A lifecycle command found no Ray cluster at the address it was given."""
