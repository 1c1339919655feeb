"""`SlotChecker`: the insert-time check of Full slots (`UnifiedRadixCache(check_slots=True)`).

A slot the tree adopts must lie in the pool, be handed out by the allocator now, appear once in
the call and not be held by the tree already (under another key or position): otherwise the
failure surfaces only later, inside `evict`, when the allocator refuses the free after the node
is gone. The checker keeps one flag per slot of the Full pool (`FullComponent.held`: set when a
leaf adopts slots, cleared when Full frees them) and one int32 stamp per slot for repeats.

Every check is a few whole-array numpy operations over the slots the caller owns
(`value[cached_len:end]`); slots the tree adopts on a host-to-device load are flagged the next
time an insert walks through their node (a miss before that is a false "not held", never a
false refusal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.errors import IndexOutOfRange, NotAllocated, ReservedIndex
from kvstrata.unified_radix_cache.errors import (
    DuplicateSlot,
    SlotInTree,
    SlotNotAllocated,
    SlotOutOfRange,
)

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.components.full import FullComponent
    from kvstrata.unified_radix_cache.node import TreeNode


_INITIAL_ROWS = 1 << 24


class _Checks(Protocol):
    def check_allocated(self, indices: torch.Tensor, name: str, /) -> None: ...


def _sample(values: npt.NDArray[np.int64]) -> str:
    shown = ", ".join(str(v) for v in values[:8].tolist())
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"


class SlotChecker:
    """Validates `insert` slots against Full's allocator and the slots the tree holds."""

    def __init__(self, full: FullComponent, page_size: int) -> None:
        allocator = full.allocator
        page = int(getattr(allocator, "page_size", page_size))
        self._full = full
        #: Slots of the pool are 0 .. rows-1 (page 0 included: the allocator refuses it).
        self._rows = full.capacity() + max(page, 1)
        # The per-slot arrays cover the slots seen so far and grow on demand (a stand-in sink
        # may announce a practically unbounded pool).
        self._held = np.zeros(min(self._rows, _INITIAL_ROWS), dtype=np.bool_)
        full.held = self._held
        self._stamp = np.zeros(len(self._held), dtype=np.int32)
        self._iota = np.arange(1024, dtype=np.int32)
        check = getattr(allocator, "check_allocated", None)
        self._allocator: _Checks | None = allocator if callable(check) else None  # pyright: ignore[reportAttributeAccessIssue]

    def _grow(self, top: int) -> None:
        size = min(self._rows, max(top + 1, 2 * len(self._held)))
        held = np.zeros(size, dtype=np.bool_)
        held[: len(self._held)] = self._held
        self._held = held
        self._full.held = held
        self._stamp = np.zeros(size, dtype=np.int32)

    def check(self, slots: npt.NDArray[np.int64], lo: int, hi: int) -> None:
        """Raise an `InvalidSlots` error unless `slots[lo:hi]` may be adopted. Changes nothing."""
        x = slots[lo:hi]
        n = len(x)
        if n == 0:
            return
        top = int(x.max())
        if int(x.min()) < 0 or top >= self._rows:
            bad = x[(x < 0) | (x >= self._rows)]
            raise SlotOutOfRange(f"insert: slots {_sample(bad)} outside [0, {self._rows})")
        if self._allocator is not None:
            try:
                self._allocator.check_allocated(self._full.to_device(x), "insert")
            except IndexOutOfRange as e:
                raise SlotOutOfRange(str(e)) from None
            except (NotAllocated, ReservedIndex) as e:  # a free page, or page 0
                raise SlotNotAllocated(str(e)) from None
        if top >= len(self._held):
            self._grow(top)
        held = self._held[x]
        if held.any():
            raise SlotInTree(
                f"insert: slots {_sample(x[held])} are already held by the tree (another key)"
            )
        if n > len(self._iota):
            self._iota = np.arange(max(n, 2 * len(self._iota)), dtype=np.int32)
        iota = self._iota[:n]
        stamp = self._stamp
        stamp[x] = iota
        repeated = stamp[x] != iota
        if repeated.any():
            raise DuplicateSlot(
                f"insert: slots given more than once {_sample(np.unique(x[repeated]))}"
            )

    def hold(self, slots: npt.NDArray[np.int64]) -> None:
        """The tree adopted `slots`."""
        if len(slots) and int(slots.max()) >= len(self._held):
            self._grow(int(slots.max()))
        self._held[slots] = True

    def hold_path(self, node: TreeNode) -> None:
        """Every device slot on the path from `node` to the root is the tree's."""
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if len(cur.value):
                self.hold(cur.value)
            cur = cur.parent
