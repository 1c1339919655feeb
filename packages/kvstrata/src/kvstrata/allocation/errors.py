"""Errors of `kvstrata.allocation`: a batch a scheduler should not have asked for.

Every one is raised before anything changes (no row, slot, lock or table cell is touched).
Running out of memory is not an error: the prepare calls return None and change nothing, and
the scheduler retracts or waits.
"""

from __future__ import annotations


class AllocationError(Exception):
    """Base of every error of `kvstrata.allocation`."""


class InvalidBatch(AllocationError, ValueError):
    """An empty batch, a request listed twice, a finished or foreign request, a chunk of no
    tokens or past the tokens the request knows, or a decode of a request not yet prefilled."""


class ContextTooLong(AllocationError, ValueError):
    """A request that would grow past the request-to-token table's `max_context_len`."""


class InvalidSetup(AllocationError, ValueError):
    """A `BatchAllocator` wired inconsistently (an allocator of another page size, a state
    pool without state slots)."""
