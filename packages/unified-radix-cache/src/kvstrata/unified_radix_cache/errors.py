"""Caller-visible errors of kvstrata.unified_radix_cache.

Every one of them is raised before the call changes anything: no node split, no slot freed,
no lock taken, no event queued. Internal invariants are `assert`s, not these.
"""

from __future__ import annotations

from kvstrata.core.errors import DuplicateIndex, IndexOutOfRange, NotAllocated


class RadixCacheError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidConfig(RadixCacheError, ValueError):
    """A constructor argument is out of range: page size < 1, unknown eviction policy, no
    `FullComponent` first, two components of one name, a component bound to another tree."""


class InvalidKey(RadixCacheError, ValueError):
    """Token ids that are not a 1-D integer sequence, or a key of another tree's namespace rules."""


class InvalidInsert(RadixCacheError, ValueError):
    """`insert` arguments that do not fit together: `value` shorter than the key, a state input
    for a component the tree does not have, a Mamba state for a key that is not page-aligned."""


class InvalidSlots(InvalidInsert):
    """`insert` slots the tree cannot adopt (checked unless the tree was built with
    `check_slots=False`). Base of the four below."""


class SlotOutOfRange(InvalidSlots, IndexOutOfRange):
    """A slot outside the component's pool."""


class SlotNotAllocated(InvalidSlots, NotAllocated):
    """A slot in a page the allocator has not handed out (free, or page 0)."""


class DuplicateSlot(InvalidSlots, DuplicateIndex):
    """A slot given twice in one `insert`."""


class SlotInTree(InvalidSlots, DuplicateIndex):
    """A slot the tree already holds for another key (or another position)."""


class HeldSlotsNotAllocated(RadixCacheError, NotAllocated):
    """`evict` found slots the tree holds that the allocator no longer has handed out (the
    engine freed them behind the tree's back). Raised with the tree, its sizes and the
    allocator as they were before the call."""


class HeldSlotsRepeated(RadixCacheError, DuplicateIndex):
    """`evict` found one slot held twice by the tree (e.g. one Mamba state slot given for two
    keys, or Full slots inserted with `check_slots=False`): freeing it would be a double free.
    Raised with the tree, its sizes and the allocators as they were before the call."""


class InvalidEvictRequest(RadixCacheError, ValueError):
    """An `EvictRequest` with a negative target or a component name the tree does not have."""


class ForeignNode(RadixCacheError, ValueError):
    """A node that is not (or no longer) part of this tree was passed to `lock`."""


class NoHostCopy(RadixCacheError, ValueError):
    """A host lock asked for a node that holds no host value (hierarchical mode)."""


class ReceiptError(RadixCacheError, RuntimeError):
    """Base of the lock-receipt errors: an unlock that does not replay an outstanding lock."""


class ReceiptAlreadyReleased(ReceiptError):
    """`unlock` with a receipt whose lock was already released (a second unlock)."""


class UnknownReceipt(ReceiptError):
    """`unlock` with a receipt this tree never issued (another tree's, or a forged one)."""


class ReceiptMismatch(ReceiptError):
    """A receipt whose id is outstanding but whose anchor or boundaries differ from the lock
    that was taken: replaying it would release someone else's segment."""


class TreeLocked(RadixCacheError, RuntimeError):
    """`reset()` while a lock receipt is outstanding (a running request still holds slots)."""


class RequestFinished(RadixCacheError, RuntimeError):
    """A request-lifecycle call on a request that `cache_finished_request` already released."""


class StateSlotsExhausted(RadixCacheError, RuntimeError):
    """Copy-on-write of a Mamba state found no free state slot, even after evicting every
    unlocked state other than the matched one. Nothing was copied or allocated."""


class IntegrityError(RadixCacheError, AssertionError):
    """`check_integrity()` found a broken invariant (a leak, a bad lock count, a stale index)."""


class EventDecodeError(RadixCacheError, ValueError):
    """Bytes that are not a KV-event batch of a version this package reads."""
