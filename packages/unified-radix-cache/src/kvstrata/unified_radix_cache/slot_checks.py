"""`SlotChecker`: the insert-time check of Full slots (`UnifiedRadixCache(check_slots=True)`).

A slot the tree adopts must lie in the pool, be handed out by the allocator now, appear once in
the call and not be held by the tree already (under another key or position): otherwise the
failure surfaces only later, inside `evict`, when the allocator refuses the free after the node
is gone. The checker keeps one int32 per slot of the Full pool (`FullComponent.held`: non-zero
while the tree holds the slot, cleared when Full frees it); the repeat test writes its stamps
into the same array.

Every check is a few whole-array numpy operations over the slots the caller owns
(`value[max(cached_len, held prefix):end]`, the held prefix found by insert's one walk); slots
the tree adopts on a host-to-device load are flagged when the load commits on a Full-only tree,
and otherwise the next time an insert walks through their node (a miss before that is a false
"not held", never a false refusal).
"""

from __future__ import annotations

from collections.abc import Callable
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


_INITIAL_ROWS = 1 << 22


#: The compiled check (`native_core.RadixCore.check_slots`): (slots, lo, hi, held, keep) ->
#: whether they passed (and were marked when keep). Typed here so that this module does not
#: import native_core (which imports the tree's internals).
CompiledCheck = Callable[[npt.NDArray[np.int64], int, int, npt.NDArray[np.int32], bool], bool]


def _zeroed(rows: int) -> npt.NDArray[np.int32]:
    """A zero int32 per slot, written once now: `np.zeros` maps its pages lazily, so an
    insert of never-seen slots would otherwise pay a page fault in its check."""
    out = np.empty(rows, dtype=np.int32)
    out.fill(0)
    return out


class _Checks(Protocol):
    def check_allocated(self, indices: torch.Tensor, name: str, /) -> None: ...


def _sample(values: npt.NDArray[np.int64]) -> str:
    shown = ", ".join(str(v) for v in values[:8].tolist())
    return f"[{shown}{', ...' if len(values) > 8 else ''}]"


class SlotChecker:
    """Validates `insert` slots against Full's allocator and the slots the tree holds."""

    def __init__(
        self, full: FullComponent, page_size: int, native: CompiledCheck | None = None
    ) -> None:
        allocator = full.allocator
        #: The compiled check (native_core.py): one pass over the slots when they are fine.
        self._native = native
        page = int(getattr(allocator, "page_size", page_size))
        self._full = full
        #: Slots of the pool are 0 .. rows-1 (page 0 included: the allocator refuses it).
        self._rows = full.capacity() + max(page, 1)
        # One int32 per slot: 0 = not the tree's; > 0 = held by the tree. `check` also writes
        # its stamps (1..n, the position in the call) there, so the held flags and the repeat
        # test share one array. It covers the slots seen so far and grows on demand (a
        # stand-in sink may announce a practically unbounded pool).
        self._held = _zeroed(min(self._rows, _INITIAL_ROWS))
        full.held = self._held
        self._set_iota(1024)
        check = getattr(allocator, "check_allocated", None)
        self._allocator: _Checks | None = allocator if callable(check) else None  # pyright: ignore[reportAttributeAccessIssue]
        #: The compiled check when it is the whole check (no allocator check to add): the
        #: tree's insert calls it with `table` and `keep`, and `check` only when it says no.
        self.compiled_alone: CompiledCheck | None = native if self._allocator is None else None

    @property
    def table(self) -> npt.NDArray[np.int32]:
        """The held flags (one int32 per slot; replaced when it grows)."""
        return self._held

    def _grow(self, top: int) -> None:
        size = min(self._rows, max(top + 1, 2 * len(self._held)))
        # Lazily zeroed here (unlike the first table): the copy below writes the old part,
        # and of the new part only the pages of slots the tree gets later are ever touched
        # (a slot counter's run grows the table mid-replay: writing all of it cost 4 %).
        held = np.zeros(size, dtype=np.int32)
        held[: len(self._held)] = self._held
        self._held = held
        self._full.held = held

    def check(self, slots: npt.NDArray[np.int64], lo: int, hi: int, *, keep: bool = False) -> None:
        """Raise an `InvalidSlots` error unless `slots[lo:hi]` may be adopted, changing nothing
        then. `keep`: the caller adopts exactly these slots now, so they stay marked as the
        tree's (the stamps below are the marks); otherwise nothing changes.

        A few whole-array calls over the slots (plus the allocator's check), none per slot and
        no ufunc reduction (their setup dominates at insert sizes): two counts of non-zero
        words (no negative slot), a gather of the marks (past the table's end: IndexError, then
        the slow path grows it or refuses), a count of slots held already, a scatter of stamps
        1..n and a gather of them read back as bytes (a repeated slot keeps one stamp)."""
        if lo >= hi:  # nothing to check (a cached_len past the stored pages): the compiled
            return  # check refuses an empty range whose bounds cross
        native = self._native
        if native is not None:
            # Compiled: in the table, unmarked, given once (then marked when `keep`). False
            # changed nothing: the checks below find and raise the precise error.
            if self._allocator is None:
                if native(slots, lo, hi, self._held, keep):
                    return
            elif native(slots, lo, hi, self._held, False):
                self._check_allocator(slots[lo:hi])
                # The allocator's check changes nothing here, so the marking pass passes too;
                # were it to fail, the Python check below decides (and marks).
                if not keep or native(slots, lo, hi, self._held, True):
                    return
        x = slots[lo:hi]
        n = len(x)
        if n == 0:
            return
        # Fast path: a run of consecutive slots inside the table (a slot counter's, or a paged
        # allocator's fresh pages) cannot repeat a slot: two scalar reads and one comparison of
        # bytes with the run's prove it is one; one slice of the table then checks and marks it.
        first = x.item(0)
        stop = first + n
        if (
            first >= 0
            and stop <= len(self._held)
            and x.item(-1) == stop - 1
            and x.tobytes() == np.arange(first, stop, dtype=np.int64).tobytes()
        ):
            self._check_run(x, first, stop, keep)
            return
        try:
            words = x.view(np.int32)
        except ValueError:  # a strided view of the caller's slots
            x = np.ascontiguousarray(x)
            words = x.view(np.int32)
        held = self._held
        # A slot in [-2**32, 0) has two non-zero int32 words; one in [0, 2**32) at most one,
        # and only if it is non-zero itself. So equal counts leave no negative slot that a
        # gather would wrap; anything else out of range makes the gather raise IndexError.
        if np.count_nonzero(words) != np.count_nonzero(x) or n > len(self._iota):
            held = self._fit(x)
        if self._allocator is not None:
            self._check_allocator(x)
        try:
            marks = held[x]
        except IndexError:  # a slot past the table: grow it, or refuse it
            held = self._fit(x)
            marks = held[x]
        if np.count_nonzero(marks):
            raise SlotInTree(
                f"insert: slots {_sample(x[marks > 0])} are already held by the tree (another key)"
            )
        stamps = self._iota[:n]
        held[x] = stamps
        if held[x].tobytes() != self._iota_bytes[: 4 * n]:
            repeated = held[x] != stamps
            held[x] = 0
            raise DuplicateSlot(
                f"insert: slots given more than once {_sample(np.unique(x[repeated]))}"
            )
        if not keep:
            held[x] = 0

    def _check_run(self, x: npt.NDArray[np.int64], first: int, stop: int, keep: bool) -> None:
        """`check` of `x`, the slots `first .. stop - 1` in order (inside the table)."""
        if self._allocator is not None:
            self._check_allocator(x)
        run = self._held[first:stop]
        if run.tobytes() != bytes(4 * (stop - first)):
            raise SlotInTree(
                f"insert: slots {_sample(x[run > 0])} are already held by the tree (another key)"
            )
        if keep:
            run.fill(1)

    def _check_allocator(self, x: npt.NDArray[np.int64]) -> None:
        assert self._allocator is not None
        try:
            self._allocator.check_allocated(self._full.to_device(x), "insert")
        except IndexOutOfRange as e:
            raise SlotOutOfRange(str(e)) from None
        except (NotAllocated, ReservedIndex) as e:  # a free page, or page 0
            raise SlotNotAllocated(str(e)) from None

    def _fit(self, x: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """The slow path of `check`: refuse slots outside the pool, grow the table to cover
        the others and the stamps to cover `len(x)`; returns the table."""
        if int(x.min()) < 0 or int(x.max()) >= self._rows:
            bad = x[(x < 0) | (x >= self._rows)]
            raise SlotOutOfRange(f"insert: slots {_sample(bad)} outside [0, {self._rows})")
        top = int(x.max())
        if top >= len(self._held):
            self._grow(top)
        if len(x) > len(self._iota):
            self._set_iota(max(len(x), 2 * len(self._iota)))
        return self._held

    def _set_iota(self, n: int) -> None:
        """Stamps 1..n and their bytes: what `check` writes and compares for up to n slots."""
        self._iota = np.arange(1, n + 1, dtype=np.int32)
        self._iota_bytes = self._iota.tobytes()

    def hold(self, slots: npt.NDArray[np.int64]) -> None:
        """The tree adopted `slots`."""
        if len(slots) and int(slots.max()) >= len(self._held):
            self._grow(int(slots.max()))
        self._held[slots] = 1

    def hold_path(self, node: TreeNode) -> None:
        """Every device slot on the path from `node` to the root is the tree's."""
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if len(cur.value):
                self.hold(cur.value)
            cur = cur.parent
