"""What the tree's operations return. The per-request results are NamedTuples (built on every
match and insert, so they must be cheap); the eviction request and result are frozen dataclasses.
`InsertCall` is the other way round: a checked insert the tree hands to its component walk.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.errors import InvalidEvictRequest
from kvstrata.unified_radix_cache.node import TreeNode

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.transfer import ComponentInsert
    from kvstrata.unified_radix_cache.key import RadixKey

#: The default of `MatchResult.states` (also given by the hot paths that give every field).
NO_STATES: Mapping[str, torch.Tensor] = MappingProxyType({})
#: `tuple.__new__`: the tree's per-request paths build a result with every field given,
#: `new_result(MatchResult, (prefix_len, indices, node, 0, None, NO_STATES))`, without the
#: generated `__new__`'s Python frame (half the cost of `MatchResult(...)`).
new_result = tuple.__new__


class MatchResult(NamedTuple):
    """A prefix match.

    `device_indices` (int64, on the Full allocator's device) are the slots of the first
    `prefix_len` tokens. They stay valid while the caller holds a lock on `last_node` (take it
    with `lock(last_node)` before anything can evict); without a lock, the next `evict` or `reset`
    may hand them to someone else. `states` maps a component name to slots the match copied
    state into for this request (Mamba copy-on-write); the caller owns those slots.
    `host_hit_len` and `last_host_node` are reserved for the hierarchical mode (always 0 / None).
    """

    prefix_len: int
    device_indices: torch.Tensor
    last_node: TreeNode
    host_hit_len: int = 0
    last_host_node: TreeNode | None = None
    states: Mapping[str, torch.Tensor] = NO_STATES


class InsertResult(NamedTuple):
    """An insert: `prefix_len` tokens of the key were already in the tree (the caller's slots
    for them are duplicates, except the ranges listed in `adopted`, which the tree took in place
    of tombstoned data), `inserted_len` new tokens now belong to the tree, and tokens past
    `prefix_len + inserted_len` (an unaligned tail, or everything when the cache is disabled) stay
    the caller's. `adopted_states` names the components that kept the state input the caller
    passed (a Mamba slot); the caller frees the inputs of the others.
    """

    prefix_len: int
    inserted_len: int
    last_node: TreeNode
    adopted: tuple[tuple[int, int], ...] = ()
    adopted_states: tuple[str, ...] = ()
    cached_len: int = 0

    def duplicates(self, value: torch.Tensor) -> torch.Tensor:
        """The caller's slots in `value[cached_len:prefix_len]` that the tree did not take: the
        ones the caller must free (slots before `cached_len` were the tree's own to begin with:
        the request's locked prefix). Pure; may return a view of `value` (always when nothing was
        adopted)."""
        start, end = self.cached_len, self.prefix_len
        if start >= end:
            return value[:0]
        if not self.adopted:
            return value[start:end]
        # The kept runs between the adopted ranges (ascending, disjoint), joined: slices and
        # one cat, not a boolean mask (a mask index costs a nonzero pass and a gather).
        parts: list[torch.Tensor] = []
        pos = start
        for lo, hi in sorted(self.adopted):
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                if pos < lo:
                    parts.append(value[pos:lo])
                pos = max(pos, hi)
        if pos < end:
            parts.append(value[pos:end])
        if not parts:
            return value[:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class LockReceipt(NamedTuple):
    """Proof of one `lock(node)`: hand it back to `unlock` exactly once.

    `boundaries[i]` is what component i locked, in its own terms, or None when it locked
    nothing: Full None (it always locks up to the root), SWA the number of tokens locked
    upward from the anchor's end (so nodes splitting inside that span change nothing), Mamba 1.
    `skipped` names components that had nothing to lock at the anchor (a tombstone, no state).
    `tree_id` names the tree that issued it.
    """

    receipt_id: int
    anchor: TreeNode
    boundaries: tuple[int | None, ...]
    skipped: tuple[str, ...] = ()
    tree_id: int = 0


@dataclass(frozen=True, kw_only=True)
class EvictRequest:
    """How much to free per component, in that component's unit (tokens for KV components,
    states for Mamba). `EvictRequest.full(n)` is the common case; a target of 0 is a no-op."""

    targets: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(type(amount) is not int for amount in self.targets.values()):
            ints: dict[str, int] = {}
            for name, amount in self.targets.items():
                try:
                    ints[name] = operator.index(amount)
                except TypeError:
                    raise InvalidEvictRequest(
                        f"evict target for {name!r} must be an integer, got {type(amount).__name__}"
                    ) from None
            object.__setattr__(self, "targets", ints)
        for name, amount in self.targets.items():
            if amount < 0:
                raise InvalidEvictRequest(f"evict target for {name!r} is negative: {amount}")

    @classmethod
    def full(cls, num_tokens: int) -> EvictRequest:
        # Once per evict in an engine's loop: the one check of __post_init__, then the frozen
        # field set directly (the generated __init__ and its loop cost 4x more).
        if type(num_tokens) is not int:
            return cls(targets={"full": num_tokens})  # the general checks
        if num_tokens < 0:
            raise InvalidEvictRequest(f"evict target for 'full' is negative: {num_tokens}")
        request = object.__new__(cls)
        object.__setattr__(request, "targets", {"full": num_tokens})
        return request


@dataclass(frozen=True, kw_only=True, init=False)
class EvictResult:
    """What an `evict` freed per component (cascades included, so SWA and Mamba may show frees
    under a Full-only request), how many nodes left the tree, and the time it took."""

    evicted: Mapping[str, int]
    nodes_removed: int
    seconds: float

    def __init__(self, *, evicted: Mapping[str, int], nodes_removed: int, seconds: float) -> None:
        # The fields written straight into the instance dict (the generated frozen __init__
        # goes through object.__setattr__ per field, at twice the cost).
        d = self.__dict__
        d["evicted"] = evicted
        d["nodes_removed"] = nodes_removed
        d["seconds"] = seconds

    @classmethod
    def of(cls, evicted: Mapping[str, int], nodes_removed: int, seconds: float) -> EvictResult:
        """The same result from positional fields (what `evict` builds once per call: a
        keyword call into `__init__` costs twice as much)."""
        result = object.__new__(cls)
        d = result.__dict__
        d["evicted"] = evicted
        d["nodes_removed"] = nodes_removed
        d["seconds"] = seconds
        return result

    def num_evicted(self, component: str = "full") -> int:
        return self.evicted.get(component, 0)


class LayerWait(Protocol):
    """What a forward waits on before reading the loaded part of a hit in one layer."""

    def wait_layer(self, layer_id: int, timeout_s: float | None = None) -> bool:
        """Block until layer `layer_id`'s pages are on the device (True), or `timeout_s`
        passed (False)."""
        ...


class PrefixHit(NamedTuple):
    """Where a request's cached prefix came from (`CacheRequest.hit`), in tokens.

    `device_len`: already on the device when matched. `host_len`: loaded back from the host.
    `storage_len`: fetched from storage into the host, then loaded back. They sum to the
    request's `cached_len`. `load`: the per-layer handle of the load (None when nothing was
    loaded); `wait_layer(i)` returns once layer i of the loaded part is on the device.
    """

    device_len: int
    host_len: int = 0
    storage_len: int = 0
    load: LayerWait | None = None

    @property
    def total_len(self) -> int:
        return self.device_len + self.host_len + self.storage_len


class InsertCall(NamedTuple):
    """One checked `UnifiedRadixCache.insert`: `data[:end]` are the whole pages of `key`'s
    token bytes to store, `slots` the Full slot of each token, `inputs` the checked
    per-component inputs (None when there are none)."""

    key: RadixKey
    data: bytes
    end: int
    slots: npt.NDArray[np.int64]
    cached_len: int
    priority: int
    inputs: Mapping[str, ComponentInsert] | None
