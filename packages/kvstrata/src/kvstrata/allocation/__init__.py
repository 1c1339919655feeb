"""Per-batch allocation for an engine's scheduler (`BatchAllocator`, see batch.py).

The scheduler admits requests, prepares extend and decode batches (KV slots, SWA slots and
Mamba state slots as named results, written into the request-to-token table), caches chunks,
finishes, retracts under memory pressure and aborts, all through one
`unified_radix_cache.PrefixCache`, so the same scheduler runs on a device-only cache and on a
tiered one.
"""

from kvstrata.allocation.batch import BatchAllocator, StatePool
from kvstrata.allocation.errors import AllocationError, ContextTooLong, InvalidBatch, InvalidSetup
from kvstrata.allocation.results import DecodeBatch, ExtendBatch, Running

__all__ = [
    "AllocationError",
    "BatchAllocator",
    "ContextTooLong",
    "DecodeBatch",
    "ExtendBatch",
    "InvalidBatch",
    "InvalidSetup",
    "Running",
    "StatePool",
]
