"""Caller-visible errors of the hybrid-cache layer.

Every one is raised before any state changes: a refused call leaves the router, the controller's
queues and its bookkeeping exactly as they were. Failures that happen later, on a worker thread,
never raise into the caller: they come back as a failed `Ack` carrying the exception.

`LayerLoadFailed` is the class of `kvstrata.core.errors` (the host tier's layer completion raises
it too), re-exported here; it is a `RuntimeError`, not a `HybridCacheError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from kvstrata.core.errors import LayerLoadFailed

T = TypeVar("T")

__all__ = [
    "ControllerClosed",
    "HybridCacheError",
    "InvalidOperation",
    "InvalidPoolLayout",
    "LayerKindMismatch",
    "LayerLoadFailed",
    "QueueFull",
    "StorageNotConfigured",
    "UnknownLayer",
    "UnknownOperation",
]


class HybridCacheError(Exception):
    """Base of every error raised by kvstrata.hybrid_cache."""


class UnknownLayer(HybridCacheError, KeyError):
    """A global layer id that no pool of the model owns."""

    def __init__(self, layer_id: int, known: range | tuple[int, ...]) -> None:
        self.layer_id = layer_id
        super().__init__(f"no pool owns layer {layer_id}; the model's layers are {_span(known)}")

    def __str__(self) -> str:
        # KeyError quotes its argument; the message reads better unquoted.
        return str(self.args[0])


class LayerKindMismatch(HybridCacheError, TypeError):
    """An attention accessor asked of a Mamba layer, or Mamba state asked of an attention layer."""


class InvalidPoolLayout(HybridCacheError, ValueError):
    """A router or pool group built from pools that do not fit together (overlapping layer ids,
    a host mirror of another shape than its device pool, duplicate member names)."""


class InvalidOperation(HybridCacheError, ValueError):
    """An operation whose arguments are malformed: unknown member, index tensors of different
    lengths or of the wrong dtype, misaligned pages, keys and page lists of different lengths."""


class StorageNotConfigured(HybridCacheError, RuntimeError):
    """A prefetch or backup submitted to a controller built without a storage backend."""


class QueueFull(HybridCacheError, RuntimeError):
    """The bounded queue of one operation kind is full: drain acknowledgements and retry.

    The submit that raised it changed nothing (no op id was consumed, no counter moved)."""

    def __init__(self, kind: str, capacity: int) -> None:
        self.kind = kind
        self.capacity = capacity
        super().__init__(
            f"{kind} queue is full ({capacity} operations waiting); "
            "drain acknowledgements (poll_acks / wait) before submitting more"
        )


class ControllerClosed(HybridCacheError, RuntimeError):
    """A submit after `TierController.close()`; also the error of queued prefetches cancelled by
    the close."""


class UnknownOperation(HybridCacheError, KeyError):
    """An op id this controller never issued, or whose acknowledgement was already handed out."""

    def __str__(self) -> str:
        return str(self.args[0])


def _span(known: range | tuple[int, ...]) -> str:
    if isinstance(known, range):
        return f"[{known.start}, {known.stop})"
    if not known:
        return "(none)"
    return ", ".join(str(i) for i in known)


def member_named(
    members: Mapping[str, T], name: str, error: type[HybridCacheError], owner: str
) -> T:
    """`members[name]`; else `error` naming the members `owner` has (a lookup, no change)."""
    try:
        return members[name]
    except KeyError:
        raise error(f"no member {name!r}; this {owner} has {', '.join(members)}") from None
