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

Hierarchical mode (host_tier.py) adds the host hooks, so the host tier treats every component
alike and a new kind of state needs no change there. A component's host copy of a node lives in
`node.comp_hosts[i]` and its slots come from the host sink given to `attach_host`:

| phase        | hook                                  | when the host tier calls it              |
|--------------|---------------------------------------|------------------------------------------|
| host match   | `host_hit_may_end`                    | may a host hit end here (restorable)     |
| device evict | `release`                             | the node goes off the device             |
| revive       | `on_revive`                           | an off-device node took device slots     |
| host store   | `set_host`                            | a committed transfer brings a host copy  |
| split        | `split_host`                          | a node with host copies splits           |
| host evict   | `take_host` / `free_host`             | the node leaves the host tier            |
| integrity    | `check_host_node` / `check_host_pool` | per node; host free + held == capacity   |

What moves between the tiers with each transfer (write, backup, prefetch, load) is the
component's `ComponentTransfer` (components/transfer.py), returned by `tier_transfer()`; a
component without one cannot be tiered.

Cascade: when a node loses a component's data, components of lower or equal `priority` lose
theirs too (Full 2 > SWA 1 > Mamba 0); a leaf that loses any component leaves the tree whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.unified_radix_cache.components.transfer import ComponentInsert, ComponentTransfer
from kvstrata.unified_radix_cache.errors import IntegrityError, InvalidConfig, InvalidInsert
from kvstrata.unified_radix_cache.policies import LRUList

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvstrata.unified_radix_cache.node import ComponentValue, TreeNode
    from kvstrata.unified_radix_cache.results import LockReceipt
    from kvstrata.unified_radix_cache.tree_view import TreeView


_NO_SLOTS = np.empty(0, dtype=np.int64)


class SlotSink(Protocol):
    """What a component needs of a slot allocator: where indices live, how to give them back,
    and (for `check_integrity`) how many are free and how many there are."""

    @property
    def device(self) -> torch.device: ...

    @property
    def size(self) -> int: ...

    def free(self, indices: torch.Tensor, /) -> None: ...

    def available_size(self) -> int: ...


class TreeComponent(ABC):
    """One kind of state held per node. Subclasses set `name` (unique in a tree), `priority`
    (cascade order on internal nodes) and `unit` (what its sizes count)."""

    name: ClassVar[str]
    priority: ClassVar[int]
    unit: ClassVar[str] = "tokens"

    def __init__(self) -> None:
        self.index = -1
        self._tree: TreeView[TreeComponent] | None = None
        #: Data not protected by any lock, and data protected by one (in `unit`).
        self.evictable_size = 0
        self.protected_size = 0
        #: Cumulative amount freed by eviction (cascades included), for metrics.
        self.evicted_total = 0
        self._pending: list[npt.NDArray[np.int64]] = []
        #: Hierarchical mode: the host slot sink of this component's host copies (None in a
        #: device-only tree), what the nodes hold of it, and what host eviction freed.
        self.host: SlotSink | None = None
        self.host_held_size = 0
        self.host_evicted_total = 0

    # -- wiring ---------------------------------------------------------------------------
    def bind(self, tree: TreeView[TreeComponent], index: int) -> None:
        """Attach to `tree` at component position `index` (called once by the tree)."""
        if self._tree is not None:
            raise InvalidConfig(f"component {self.name!r} is already bound to a tree")
        self._tree = tree
        self.index = index

    @property
    def tree(self) -> TreeView[TreeComponent]:
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

    # -- host tier (hierarchical mode) --------------------------------------------------------
    def attach_host(self, sink: SlotSink) -> None:
        """Hold host copies in slots of `sink` (called once, by the host tier)."""
        if self.host is not None:
            raise InvalidConfig(f"component {self.name!r} already has a host sink")
        self.host = sink

    def host_value(self, node: TreeNode) -> ComponentValue:
        """This component's host copy on `node`, or None."""
        hosts = node.comp_hosts
        return None if hosts is None else hosts[self.index]

    def host_slots(self, value: ComponentValue) -> npt.NDArray[np.int64]:
        """The host slots a host copy `value` holds (one per token, or one state slot)."""
        if value is None:
            return _NO_SLOTS
        if isinstance(value, int):
            return np.array([value], dtype=np.int64)
        return value

    def host_size(self, node: TreeNode) -> int:
        """Host slots of this component on `node` (0 without a host copy)."""
        return len(self.host_slots(self.host_value(node)))

    def set_host(self, node: TreeNode, value: ComponentValue) -> bool:
        """`node` (with a Full host value) takes host copy `value`. Returns False, taking
        nothing, when it already has one (the caller frees `value`)."""
        assert node.host_value is not None, (
            f"{self.name} host copy on node {node.id} without a host value"
        )
        assert value is not None
        hosts = node.comp_hosts
        if hosts is None:
            empty: list[ComponentValue] = [None] * len(self.tree.components)
            hosts = node.comp_hosts = empty
        elif hosts[self.index] is not None:
            return False
        self.check_host_value(node, value)
        hosts[self.index] = value
        self.host_held_size += len(self.host_slots(value))
        return True

    def check_host_value(self, node: TreeNode, value: ComponentValue) -> None:
        """Assert that `value` fits `node` (a slot array: one slot per token)."""
        if not isinstance(value, int):
            assert value is not None and len(value) == node.num_tokens, (
                f"node {node.id}: {0 if value is None else len(value)} {self.name} host slots"
            )

    def take_host(self, node: TreeNode) -> npt.NDArray[np.int64] | None:
        """Remove this component's host copy from `node`; its slots (to hand to `free_host`),
        or None when it had none."""
        hosts = node.comp_hosts
        if hosts is None or hosts[self.index] is None:
            return None
        slots = self.host_slots(hosts[self.index])
        hosts[self.index] = None
        self.host_held_size -= len(slots)
        return slots

    def free_host(self, parts: list[npt.NDArray[np.int64]]) -> None:
        """Hand host slots taken from the nodes back to the host sink (one call)."""
        if parts:
            assert self.host is not None, f"{self.name} host slots without a host sink"
            self.host.free(torch.from_numpy(np.concatenate(parts)))

    def split_host(self, upper: TreeNode, lower: TreeNode) -> None:
        """`lower` split, `upper` took its first `upper.num_tokens` tokens: a per-token host
        copy is sliced; a per-node one (a state at the end of the run) stays on `lower`."""
        hosts = lower.comp_hosts
        value = None if hosts is None else hosts[self.index]
        if hosts is None or value is None or isinstance(value, int):
            return
        cut = upper.num_tokens
        upper_hosts = upper.comp_hosts
        if upper_hosts is None:
            empty: list[ComponentValue] = [None] * len(hosts)
            upper_hosts = upper.comp_hosts = empty
        upper_hosts[self.index] = value[:cut]
        hosts[self.index] = value[cut:]

    def host_hit_may_end(self, node: TreeNode) -> bool:
        """Whether a host hit may end at `node` (which has a Full host value or is on the
        device): this component's data for the prefix is restorable there. Default: yes."""
        return True

    def on_revive(  # noqa: B027
        self, node: TreeNode, start: int, inp: ComponentInsert | None
    ) -> None:
        """Optional hook: off-device `node` (key positions from `start`) took device slots
        again (an insert over it, or a load-back with input `inp`)."""

    def check_host_node(self, node: TreeNode) -> None:
        """A host copy only beside a Full host value; device data only on the device."""
        value = self.host_value(node)
        if value is not None and (
            node.host_value is None
            or (not isinstance(value, int) and len(value) != node.num_tokens)
        ):
            raise IntegrityError(f"node {node.id}: host {self.name} copy without a host value")
        if self.node_size(node) and not node.on_device:
            raise IntegrityError(f"node {node.id}: device {self.name} data off the device")

    def check_host_pool(self, held: list[npt.NDArray[np.int64]], in_flight: int) -> None:
        """`held`: the host slots the nodes hold. No slot twice, the counter right, and host
        free + held + `in_flight` (held by transfers) == host capacity."""
        slots = np.concatenate(held) if held else _NO_SLOTS
        if len(np.unique(slots)) != len(slots) or len(slots) != self.host_held_size:
            raise IntegrityError(
                f"host {self.name}: {len(slots)} slots on nodes ({len(np.unique(slots))} "
                f"distinct), counter says {self.host_held_size}"
            )
        sink = self.host
        if sink is not None:
            free = sink.available_size()
            if free + len(slots) + in_flight != sink.size:
                raise IntegrityError(
                    f"host {self.name} pool: free {free} + held {len(slots)} + in flight "
                    f"{in_flight} != capacity {sink.size}"
                )

    def reset_host(self) -> None:
        """Forget the host copies (the host tier freed their slots)."""
        self.host_held_size = 0

    def tier_transfer(self) -> ComponentTransfer | None:
        """How this component's data moves between the tiers of a `HierarchicalCache`
        (components/transfer.py), or None when it cannot be tiered. Default: None."""
        return None


class LRUListComponent(TreeComponent):
    """A component whose data is evicted from its own LRU list threaded through the nodes
    (SWA and Mamba), so internal nodes can lose their data without touching the leaves.

    A node is on the list while it holds this component's data and no lock of it; the lock
    helpers move a node's `size` between `evictable_size` and `protected_size` as its lock
    count leaves or reaches zero."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.lru = LRUList()

    def on_access(self, node: TreeNode) -> None:
        if node in self.lru:
            self.lru.touch(node)

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

    def flush(self) -> None:
        """Hand the queued slots to `give_back` in one call (moved to the device first)."""
        slots = self.take_pending()
        if slots is not None and len(slots):
            tensor = torch.from_numpy(slots)
            self.give_back(tensor if self.device.type == "cpu" else tensor.to(self.device))

    def lock_node(self, node: TreeNode, size: int) -> None:
        """Add one lock of this component to `node` (holding `size` of its data)."""
        locks = node.comp_locks
        assert locks is not None
        if locks[self.index] == 0:
            self.evictable_size -= size
            self.protected_size += size
            self.lru.discard(node)
        locks[self.index] += 1

    def unlock_node(self, node: TreeNode, size: int) -> None:
        """Drop one lock `lock_node(node, size)` added."""
        locks = node.comp_locks
        assert locks is not None and locks[self.index] > 0, (
            f"{type(self).__name__}: unlock below zero at node {node.id}"
        )
        locks[self.index] -= 1
        if locks[self.index] == 0:
            self.evictable_size += size
            self.protected_size -= size
            self.lru.touch(node)

    def check_listed(self, node: TreeNode, has_data: bool) -> None:
        """A lock only where there is data; on the LRU list exactly when held and unlocked."""
        assert node.comp_locks is not None
        lock = node.comp_locks[self.index]
        if not has_data and lock:
            raise IntegrityError(f"node {node.id}: {self.name} lock {lock} without data")
        listed = node in self.lru
        if listed != (has_data and lock == 0):
            raise IntegrityError(f"node {node.id}: {self.name} LRU membership {listed} is wrong")

    def check_lock_counts(self, expected: dict[int, int]) -> None:
        """Each node's lock count equals `expected[node.id]` (0 when absent), what the
        outstanding receipts imply."""
        i = self.index
        for node in self.tree.iter_nodes():
            assert node.comp_locks is not None
            if node.comp_locks[i] != expected.get(node.id, 0):
                raise IntegrityError(
                    f"node {node.id}: {self.name} lock {node.comp_locks[i]}, "
                    f"receipts say {expected.get(node.id, 0)}"
                )

    def reset(self) -> None:
        super().reset()
        self.lru.clear()
