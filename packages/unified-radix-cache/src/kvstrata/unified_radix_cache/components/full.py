"""`FullComponent`: full-attention KV slots, one per token, on every node.

Full data never becomes a tombstone: only whole leaves (or the tail pages of one) go, taken from
the `LeafHeap` in policy order. A lock protects the whole path to the root. Component 0 of every
tree; the tree's hot loops read `node.value` / `node.lock_ref` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator import SWAAllocator
from kvstrata.allocator.errors import IndexOutOfRange, NotAllocated, ReservedIndex
from kvstrata.unified_radix_cache.components.base import SlotSink, TreeComponent
from kvstrata.unified_radix_cache.errors import (
    HeldSlotsNotAllocated,
    HeldSlotsRepeated,
    IntegrityError,
)
from kvstrata.unified_radix_cache.key import TOKEN_BYTES
from kvstrata.unified_radix_cache.node import NO_CHILDREN
from kvstrata.unified_radix_cache.policies import LeafHeap

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.events import KVEvent
    from kvstrata.unified_radix_cache.node import TreeNode
    from kvstrata.unified_radix_cache.results import LockReceipt
    from kvstrata.unified_radix_cache.tree_view import TreeView


#: Evicts `amount` Full tokens, recording removed nodes and cut leaves for an undo when given
#: lists; returns the tokens freed (`FullComponent._evict`'s contract). The last argument:
#: `flush()` too, in the same call.
LeafEvictor = Callable[
    [
        int,
        "list[tuple[TreeNode, TreeNode]] | None",
        "list[tuple[TreeNode, npt.NDArray[np.int64], bytes, list[bytes] | None]] | None",
        bool,
    ],
    int,
]


def has_repeats(slots: npt.NDArray[np.int64]) -> bool:
    """Whether a slot appears twice: one sort and one comparison of neighbours (np.unique's
    hash table cost 6x more on an evict's few hundred slots, 12x on thousands)."""
    ordered = np.sort(slots)
    return bool((ordered[1:] == ordered[:-1]).any())


class FullComponent(TreeComponent):
    """Full KV slots. `allocator` is the Full pool's slot allocator (or an SWA allocator, whose
    `free` releases a token's full and SWA slots together)."""

    name = "full"
    priority = 2

    def __init__(self, allocator: SlotSink) -> None:
        super().__init__()
        self.allocator = allocator
        self.device = torch.device(allocator.device)
        self._on_cpu = self.device.type == "cpu"
        check = getattr(allocator, "check_allocated", None)
        #: The allocator's `check_allocated` (None when it has none): `evict_checked` uses it.
        self._check_allocated = cast(
            "Callable[[torch.Tensor, str], None] | None", check if callable(check) else None
        )
        # An SWA allocator manages two pools; Full accounts against its full pool only (its
        # available_size() is the smaller of the two).
        if isinstance(allocator, SWAAllocator):
            self._free_size: Callable[[], int] = allocator.full_available_size
            self._capacity = allocator.full_size
        else:
            self._free_size = allocator.available_size
            self._capacity = int(allocator.size)
        self.heap: LeafHeap | None = None
        #: Set when the tree gets a host tier: a device leaf may then have off-device children.
        self.tiered = False
        #: Per slot, non-zero while the tree holds it (set by the tree's `SlotChecker`, None when
        #: the tree does not check insert slots); cleared here when the slots are freed.
        self.held: npt.NDArray[np.int32] | None = None
        #: The compiled `_evict` loop (`native_core.evict_leaves`), set by a Full-only device
        #: tree without events that has the compiled core; None runs the loop below.
        self.leaf_evictor: LeafEvictor | None = None
        #: The compiled lock / unlock walks (`native_core.install`; None: the loops below):
        #: (anchor, root, heap members) -> tokens locked or None for a foreign anchor, and
        #: (anchor, heap) -> tokens unlocked.
        self.path_lock: Callable[[TreeNode, TreeNode, dict[int, TreeNode]], int | None] | None
        self.path_lock = None
        self.path_unlock: Callable[[TreeNode, LeafHeap], int] | None = None
        #: The compiled array work of `flush` (`native_core.RadixCore.drain`, set by a tree
        #: with the compiled core; None: numpy below): the queued slots joined into one
        #: bytearray, the list emptied, the held flags cleared.
        self.drain: (
            Callable[[list[npt.NDArray[np.int64]], npt.NDArray[np.int32] | None], bytearray | None]
            | None
        ) = None

    def drop_compiled(self) -> None:
        """Back to the Python loops (a host tier's walks take Full eviction over)."""
        self.leaf_evictor = self.path_lock = self.path_unlock = None

    def bind(self, tree: TreeView[TreeComponent], index: int) -> None:
        super().bind(tree, index)
        self.heap = LeafHeap(tree.policy)

    def capacity(self) -> int:
        return self._capacity

    def free_size(self) -> int:
        return int(self._free_size())

    def node_size(self, node: TreeNode) -> int:
        return len(node.value)

    def node_lock(self, node: TreeNode) -> int:
        return node.lock_ref

    def to_device(self, slots: npt.NDArray[np.int64]) -> torch.Tensor:
        """Slots as an int64 tensor on the allocator's device (shares memory on CPU)."""
        out = torch.from_numpy(slots)
        return out if self._on_cpu else out.to(self.device)

    # -- structure --------------------------------------------------------------------------
    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        # Both halves keep their slices (the tree cut them); the new parent inherits the locks,
        # so sizes do not move: the same tokens stay evictable or protected.
        upper.lock_ref = lower.lock_ref

    # -- eviction -------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        """Take whole leaves in policy order; from the last one only the tail pages needed, so
        at most `page_size - 1` tokens more than asked go."""
        return self._evict(amount, None, None)

    def _evict(
        self,
        amount: int,
        removed: list[tuple[TreeNode, TreeNode]] | None,
        cut: list[tuple[TreeNode, npt.NDArray[np.int64], bytes, list[bytes] | None]] | None,
    ) -> int:
        if self.leaf_evictor is not None:
            return self.leaf_evictor(amount, removed, cut, False)
        tree = self.tree
        heap = self.heap
        assert heap is not None
        freed = 0
        for node, keep in heap.victims(amount, tree.page_size):
            if keep > 0:
                # The last leaf keeps its head (and its heap entry: the policy key does not
                # change) and gives up just enough tail pages.
                if cut is not None:
                    cut.append((node, node.value, node.key, node.page_keys))
                freed += tree.truncate_leaf(node, keep)
                break
            heap.pop_peeked(node)
            if removed is not None:
                assert node.parent is not None
                removed.append((node, node.parent))
            freed += tree.remove_leaf(node, evicted=True)
        return freed

    def evict_checked(
        self, amount: int, events: list[KVEvent] | None, *, repeats: bool = False
    ) -> None:
        """`evict(amount)` then `flush()` on a Full-only device tree, checking the freed slots
        with the allocator's `check_allocated` (one call) first: when the allocator no longer
        has them handed out (a free behind the tree's back), every node, size, heap entry and
        queued event is put back and `HeldSlotsNotAllocated` is raised with the allocator
        untouched. `events`: the tree's event queue (None when events are off). `repeats`: also
        refuse a slot freed twice (HeldSlotsRepeated), for a tree that did not check its insert
        slots."""
        check = self._check_allocated
        if check is None and not repeats:
            evictor = self.leaf_evictor  # the compiled loop and the flush, in one call
            if evictor is not None:
                evictor(amount, None, None, True)
            else:
                self._evict(amount, None, None)
                self.flush()
            return
        removed: list[tuple[TreeNode, TreeNode]] = []
        cut: list[tuple[TreeNode, npt.NDArray[np.int64], bytes, list[bytes] | None]] = []
        queued = len(events) if events is not None else 0
        pending = len(self._pending)
        self._evict(amount, removed, cut)
        if len(self._pending) > pending:
            slots = np.concatenate(self._pending[pending:])
            refused: Exception | None = None
            try:
                if check is not None:
                    check(self.to_device(slots), "evict: tree-held slots")
            except (IndexOutOfRange, NotAllocated, ReservedIndex) as exc:
                refused = HeldSlotsNotAllocated(
                    f"evict: the allocator no longer has slots the tree holds handed out "
                    f"(freed behind the tree's back?); nothing was evicted: {exc}"
                )
                refused.__cause__ = exc
            if refused is None and repeats and has_repeats(slots):
                refused = HeldSlotsRepeated(
                    "evict: the tree holds some full slots twice (inserted with check_slots "
                    "off); freeing them would be a double free; nothing was evicted"
                )
            if refused is not None:
                del self._pending[pending:]
                if events is not None:
                    del events[queued:]
                self._roll_back(removed, cut)
                raise refused
        self.flush()

    def _roll_back(
        self,
        removed: list[tuple[TreeNode, TreeNode]],
        cut: list[tuple[TreeNode, npt.NDArray[np.int64], bytes, list[bytes] | None]],
    ) -> None:
        tree = self.tree
        heap = self.heap
        assert heap is not None
        for node, value, key, page_keys in cut:
            size = len(value) - len(node.value)
            node.value, node.key, node.page_keys = value, key, page_keys
            self.evictable_size += size
            self.evicted_total -= size
        for node, parent in reversed(removed):
            if parent.heap_entry is not None:  # it became a leaf when `node` went
                heap.discard(parent)
            if parent.children is NO_CHILDREN:
                parent.children = {}
            first = node.key[: tree.page_size * TOKEN_BYTES]
            parent.children[(node.namespace, first) if parent.parent is None else first] = node
            node.parent = parent
            tree.num_nodes += 1
            size = len(node.value)
            self.evictable_size += size
            self.evicted_total -= size
            heap.push(node)

    def release(self, node: TreeNode, node_goes: bool) -> int:
        assert node.lock_ref == 0, f"FullComponent: releasing locked node {node.id}"
        assert node_goes, "FullComponent data never becomes a tombstone; only leaves go"
        size = len(node.value)
        self.evictable_size -= size
        self._pending.append(node.value)
        return size

    def flush(self) -> None:
        drain = self.drain
        if drain is not None:
            if not self._pending:
                return
            joined = drain(self._pending, self.held)
            if joined is not None:
                self.free_joined(joined)
            return
        slots = self.take_pending()
        if slots is not None and len(slots):
            # The flags go before the free, as `drain` clears them: the nodes have left the
            # tree, so a `free` that raises leaves the same state on both paths.
            held = self.held
            if held is not None:
                try:
                    held[slots] = 0
                except IndexError:  # slots past its end were never marked
                    held[slots[slots < len(held)]] = 0
            self.allocator.free(self.to_device(slots))

    def free_joined(self, joined: bytearray) -> None:
        """Free the slots `drain` joined (native int64 bytes) in one allocator call."""
        self.allocator.free(
            torch.frombuffer(joined, dtype=torch.int64)
            if self._on_cpu
            else self.to_device(np.frombuffer(joined, dtype=np.int64))
        )

    def give_back(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    # -- locking ----------------------------------------------------------------------------
    def lock(self, anchor: TreeNode) -> int | None:
        """Protect the path from `anchor` to the root. Boundary: None (always the root)."""
        heap = self.heap
        assert heap is not None
        moved = 0
        node = anchor
        parent = node.parent
        while parent is not None:
            if node.lock_ref == 0:
                moved += len(node.value)
                if node.heap_entry is not None:
                    heap.discard(node)
            node.lock_ref += 1
            node = parent
            parent = node.parent
        self.evictable_size -= moved
        self.protected_size += moved
        return None

    def unlock(self, anchor: TreeNode, boundary: int | None) -> None:
        heap = self.heap
        assert heap is not None
        if self.path_unlock is not None:
            moved = self.path_unlock(anchor, heap)
            self.evictable_size += moved
            self.protected_size -= moved
            return
        moved = 0
        node = anchor
        parent = node.parent
        while parent is not None:
            assert node.lock_ref > 0, f"FullComponent: unlock below zero at node {node.id}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.value)
                if not node.children:
                    heap.push(node)
                elif self.tiered and not any(len(c.value) for c in node.children.values()):
                    heap.push(node)  # hierarchical: only off-device children below it
            node = parent
            parent = node.parent
        self.evictable_size += moved
        self.protected_size -= moved

    # -- integrity ------------------------------------------------------------------------
    def check_node(self, node: TreeNode) -> None:
        assert self.heap is not None
        in_heap = node in self.heap
        if self.tiered:
            # Hierarchical: a device leaf is an on-device node without an on-device child.
            should = (
                node.on_device
                and node.lock_ref == 0
                and not any(c.on_device for c in node.children.values())
            )
        else:
            should = not node.children and node.lock_ref == 0
        if in_heap != should:
            raise IntegrityError(
                f"node {node.id}: in evictable-leaf heap={in_heap}, but leaf and unlocked={should}"
            )
        off_device = not node.on_device and node.host_value is not None
        if node.value.dtype != np.int64 or (len(node.value) != node.num_tokens and not off_device):
            raise IntegrityError(
                f"node {node.id}: {len(node.value)} Full slots for {node.num_tokens} tokens"
            )

    def check_locks(self, receipts: Iterable[LockReceipt]) -> None:
        assert self.heap is not None
        self.heap.check_integrity()
        expected: dict[int, int] = {}
        for receipt in receipts:
            for node in receipt.anchor.path_to_root():
                expected[node.id] = expected.get(node.id, 0) + 1
        for node in self.tree.iter_nodes():
            if node.lock_ref != expected.get(node.id, 0):
                raise IntegrityError(
                    f"node {node.id}: Full lock_ref {node.lock_ref}, "
                    f"receipts say {expected.get(node.id, 0)}"
                )

    def reset(self) -> None:
        super().reset()
        if self.heap is not None:
            self.heap.clear()
        if self.held is not None:
            self.held[:] = 0
