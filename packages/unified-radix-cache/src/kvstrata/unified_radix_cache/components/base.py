"""`TreeComponent`: how one kind of state plugs into the tree.

The tree works on keys only. Each component owns its data on every node (`node.comp_values[i]`
and `node.comp_locks[i]`; FullComponent, always index 0, uses `node.value` and `node.lock_ref`)
and the tree calls its hooks at fixed points, so a new state family needs no change to the tree:

| phase           | hook                 | when the tree calls it                                  |
|-----------------|----------------------|---------------------------------------------------------|
| match           | `match_end`          | after the walk: how many path nodes the match may keep  |
| finalize match  | `finalize_match`     | after validation, before any access time is touched     |
| access          | `on_access`          | each kept node, root first (component LRU lists)        |
| split           | `on_split`           | a node split at a page boundary into upper + lower      |
| insert overlap  | `on_insert_overlap`  | each existing node the inserted key runs over           |
| insert new      | `on_insert_new`      | the leaf an insert creates                              |
| insert commit   | `on_insert_commit`   | the node ending at the key, with the caller's input     |
| evict           | `evict` / `release`  | its own eviction; `release` frees its data on one node  |
| lock            | `lock` / `unlock`    | `lock(node)` / `unlock(receipt)`                        |

Cascade: when a node loses a component's data, components of lower or equal `priority` lose
theirs too (Full 2 > SWA 1 > Mamba 0); a leaf that loses any component leaves the tree whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.errors import InvalidConfig, InvalidInsert
from kvstrata.unified_radix_cache.policies import LRUList

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.results import LockReceipt
    from kvstrata.unified_radix_cache.tree import UnifiedRadixCache


class SlotSink(Protocol):
    """What a component needs of a slot allocator: where indices live, how to give them back,
    and (for `check_integrity`) how many are free and how many there are."""

    @property
    def device(self) -> torch.device: ...

    @property
    def size(self) -> int: ...

    def free(self, indices: torch.Tensor, /) -> None: ...

    def available_size(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class ComponentInsert:
    """Base of the per-component inputs to `insert(..., inputs={name: ...})`."""


class TreeComponent(ABC):
    """One kind of state held per node. Subclasses set `name` (unique in a tree), `priority`
    (cascade order on internal nodes) and `unit` (what its sizes count)."""

    name: ClassVar[str]
    priority: ClassVar[int]
    unit: ClassVar[str] = "tokens"

    def __init__(self) -> None:
        self.index = -1
        self._tree: UnifiedRadixCache | None = None
        #: Data not protected by any lock, and data protected by one (in `unit`).
        self.evictable_size = 0
        self.protected_size = 0
        #: Cumulative amount freed by eviction (cascades included), for metrics.
        self.evicted_total = 0
        self._pending: list[npt.NDArray[np.int64]] = []

    # -- wiring ---------------------------------------------------------------------------
    def bind(self, tree: UnifiedRadixCache, index: int) -> None:
        """Attach to `tree` at component position `index` (called once by the tree)."""
        if self._tree is not None:
            raise InvalidConfig(f"component {self.name!r} is already bound to a tree")
        self._tree = tree
        self.index = index

    @property
    def tree(self) -> UnifiedRadixCache:
        assert self._tree is not None, f"component {self.name!r} used before bind()"
        return self._tree

    # -- pool accounting --------------------------------------------------------------------
    @abstractmethod
    def capacity(self) -> int:
        """Slots of the pool this component frees into (the integrity check's right side)."""

    @abstractmethod
    def free_size(self) -> int:
        """Slots free in that pool now (from its allocator)."""

    @abstractmethod
    def node_size(self, node: TreeNode) -> int:
        """Amount of this component's data on `node` (0 for a tombstone)."""

    def node_lock(self, node: TreeNode) -> int:
        assert node.comp_locks is not None, "non-Full component on a Full-only node"
        return node.comp_locks[self.index]

    # -- match ------------------------------------------------------------------------------
    def match_end(self, path: list[TreeNode]) -> int:
        """How many leading nodes of `path` (root excluded, root side first) the match may keep:
        the match ends after `path[k-1]`, k = the returned value (0: nothing matches)."""
        return len(path)

    def finalize_match(self, node: TreeNode, copy_state: bool) -> torch.Tensor | None:
        """After the match is fixed at `node`: return slots this request now owns (copy-on-write
        of state), or None. Must raise before changing anything if it cannot."""
        return None

    def on_access(self, node: TreeNode) -> None:  # noqa: B027
        """Optional hook: `node` was used by a match or insert (called root side first)."""

    # -- structure ------------------------------------------------------------------------
    @abstractmethod
    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`lower` (the original node) lost its first `upper.num_tokens` tokens to the new
        `upper`, its new parent; `upper.value`/`lower.value` already hold the Full slices."""

    def check_insert_input(self, inp: ComponentInsert, num_tokens: int) -> None:
        """Validate this component's `insert` input for a key of `num_tokens` tokens; raise
        InvalidInsert (before the tree changes anything). Default: takes no input."""
        raise InvalidInsert(f"component {self.name!r} takes no insert input")

    def on_insert_overlap(
        self,
        node: TreeNode,
        start: int,
        value: npt.NDArray[np.int64],
        inp: ComponentInsert | None,
        cached_len: int,
    ) -> bool:
        """The inserted key covers all of existing `node`, starting at key position `start`;
        `value` is the caller's slots for the whole key. Return True if this component adopted
        `value[start:start + node.num_tokens]` in place of the node's slots (the tree then
        reports the range as adopted). Default: nothing to do."""
        return False

    def on_insert_new(  # noqa: B027
        self, node: TreeNode, start: int, inp: ComponentInsert | None
    ) -> None:
        """Optional hook: the insert created leaf `node` for key positions
        `[start, start + node.num_tokens)`."""

    def on_insert_commit(self, node: TreeNode, inp: ComponentInsert | None) -> bool:
        """The insert's key ends exactly at `node`. Return True if `inp` was adopted."""
        return False

    # -- eviction -------------------------------------------------------------------------
    @abstractmethod
    def evict(self, amount: int) -> int:
        """Free at least `amount` (or everything evictable) by this component's own order;
        return what was freed by this component. Frees reach the allocator at `flush()`."""

    @abstractmethod
    def release(self, node: TreeNode, node_goes: bool) -> int:
        """Drop this component's data on `node` (which must not be locked by it), adjust the
        sizes, queue the slots for `flush()`; return the amount dropped. `node_goes`: the node
        leaves the tree and FullComponent frees its slots (so an SWA slot goes with it)."""

    @abstractmethod
    def flush(self) -> None:
        """Hand every queued slot to the allocator in one call."""

    @abstractmethod
    def give_back(self, slots: torch.Tensor) -> None:
        """Free slots that are not in the tree (a request's own) into this component's pool."""

    def queue_free(self, slots: npt.NDArray[np.int64]) -> None:
        self._pending.append(slots)

    def take_pending(self) -> npt.NDArray[np.int64] | None:
        pending = self._pending
        if not pending:
            return None
        out = pending[0] if len(pending) == 1 else np.concatenate(pending)
        pending.clear()
        return out

    # -- locking ----------------------------------------------------------------------------
    @abstractmethod
    def lock(self, anchor: TreeNode) -> int | None:
        """Protect what a request ending at `anchor` needs; return the boundary to record in the
        receipt (component-defined), or None when nothing was locked."""

    @abstractmethod
    def unlock(self, anchor: TreeNode, boundary: int | None) -> None:
        """Undo exactly the `lock(anchor)` that returned `boundary`."""

    # -- integrity ------------------------------------------------------------------------
    @abstractmethod
    def check_node(self, node: TreeNode) -> None:
        """Per-node invariants of this component (raise IntegrityError)."""

    @abstractmethod
    def check_locks(self, receipts: Iterable[LockReceipt]) -> None:
        """Lock counts on the nodes equal what the outstanding receipts imply (IntegrityError)."""

    def reset(self) -> None:
        """Forget every node (the tree is clearing itself; slots were queued already)."""
        self.evictable_size = 0
        self.protected_size = 0


class LRUListComponent(TreeComponent):
    """A component whose data is evicted from its own LRU list threaded through the nodes
    (SWA and Mamba), so internal nodes can lose their data without touching the leaves."""

    lru: LRUList

    def evict(self, amount: int) -> int:
        """Release the least recently used unlocked data until `amount` is freed or the list is
        empty; cascades follow `tree.evict_component`. Returns what was freed."""
        tree = self.tree
        freed = 0
        while freed < amount:
            node = self.lru.pop_lru()
            if node is None:
                break
            freed += tree.evict_component(node, self)
        return freed
