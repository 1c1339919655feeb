"""FreeIds: which ids of a fixed range are free, on the host. One implementation for the host
tier's page allocator (`pool_host.HostSlotAllocator`) and the device pools' request rows
(`pool.ReqToTokenPool`). (The device slot allocator keeps its own free stack, in
`allocator.engine`: it lives on the accelerator and is fused with the page arithmetic.)

```
 ids:      first .. first + num_ids - 1
 _fresh    sorted ascending; take() cuts from its front, so ids come out in ascending runs
 _given    arrays given back since the last merge; merged into _fresh (sorted) only when
           _fresh alone cannot satisfy a take, which keeps take and give O(n) almost always
 _is_free  bitmap over the range: True iff the id is in _fresh or _given; what turns a double
           free, a repeat or a corrupt list into an error instead of silent corruption
```
Ascending, contiguous ids make a host transfer one large copy per run instead of one per page.
Not thread-safe: an owner shared between threads (the host allocator) holds its own lock.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstrata.core.errors import DoubleFree, IndexOutOfRange, IntegrityError

__all__ = ["FreeIds", "IdArray"]

IdArray = npt.NDArray[np.int64]


class FreeIds:
    """The free ids of `first .. first + num_ids - 1` (all free at first).

    `what` names the ids in error messages ("host pages", "rows"). Every call validates before
    it changes anything.
    """

    def __init__(self, num_ids: int, *, first: int = 0, what: str = "ids") -> None:
        if num_ids < 0:
            raise IndexOutOfRange(f"a range of {what} needs num_ids >= 0, got {num_ids}")
        self.num_ids = num_ids
        self.first = first
        self.what = what
        self._fresh: IdArray = np.arange(first, first + num_ids, dtype=np.int64)
        self._given: list[IdArray] = []
        self._num_given = 0
        self._is_free = np.ones(num_ids, dtype=np.bool_)
        # Scratch for the repeat check of `give` (see `_repeats`); its contents mean nothing.
        self._stamps = np.zeros(num_ids, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return self._fresh.size + self._num_given

    def take(self, n: int) -> IdArray | None:
        """`n` free ids, ascending within what was free (fresh ids first, then given-back ones
        merged in order), or None when fewer are free (nothing changes then). The returned
        array is the caller's. IntegrityError (nothing taken) if an id on the list is not
        marked free: the list was corrupted from outside."""
        assert n >= 0, "take(n) needs n >= 0; the owner validates its callers' counts"
        if n > self.num_free:
            return None
        if n > self._fresh.size:
            self._merge()
        ids = self._fresh[:n]
        marks = self._is_free[ids - self.first]
        if not marks.all():
            raise IntegrityError(
                f"{self.what} {ids[~marks][:8].tolist()} are on the free list but allocated: "
                "the free list is corrupt (a free of ids this list never gave?)"
            )
        self._fresh = self._fresh[n:]
        self._is_free[ids - self.first] = False
        return ids.copy()

    def give(self, ids: IdArray) -> None:
        """Return allocated ids. IndexOutOfRange for an id outside the range, DoubleFree for an
        id that is free already or listed twice; on either nothing changes. An empty array is a
        no-op; the array is copied (the caller may reuse it)."""
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < self.first or hi >= self.first + self.num_ids:
            raise IndexOutOfRange(
                f"{self.what} must lie in [{self.first}, {self.first + self.num_ids}), "
                f"got range [{lo}, {hi}]"
            )
        offsets = ids - self.first
        if _repeats(offsets, self._stamps):
            raise DoubleFree(f"the same {self.what} are listed twice in one free")
        already = self._is_free[offsets]
        if already.any():
            raise DoubleFree(f"{self.what} {ids[already][:8].tolist()} are already free")
        self._is_free[offsets] = True
        self._given.append(ids.astype(np.int64, copy=True))
        self._num_given += ids.size

    # -- for an owner's compiled take / give (pool_host.slots): it reads and writes `is_free`
    # exactly as `take` / `give` would (checking everything first), then records the move here.

    @property
    def is_free(self) -> npt.NDArray[np.bool_]:
        """The free bitmap (index id - first; fixed in memory for the list's life)."""
        return self._is_free

    def fresh_front(self, n: int) -> IdArray | None:
        """The `n` ids `take(n)` would hand out, in order, or None when fewer are free;
        changes only the list's internal order (a merge, as `take` does). The caller marks
        them taken in `is_free` and then calls `cut_front(n)`."""
        assert n >= 0, "fresh_front(n) needs n >= 0; the owner validates its callers' counts"
        if n > self.num_free:
            return None
        if n > self._fresh.size:
            self._merge()
        return self._fresh[:n]

    def cut_front(self, n: int) -> None:
        """The first `n` ids of `fresh_front(n)` were taken (and marked so by the caller)."""
        self._fresh = self._fresh[n:]

    def given_marked(self, ids: IdArray) -> None:
        """`ids` (the caller's array, now the list's) were given back, checked and marked free
        in `is_free` by the caller as `give` checks and marks them."""
        self._given.append(ids)
        self._num_given += ids.size

    def allocated(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        """Per id (all in range: the caller checked), whether it is handed out now."""
        return ~self._is_free[ids - self.first]

    def clear(self) -> None:
        """Every id free again (ids handed out before become invalid)."""
        self._fresh = np.arange(self.first, self.first + self.num_ids, dtype=np.int64)
        self._given = []
        self._num_given = 0
        self._is_free[:] = True

    def check_integrity(self) -> None:
        """IntegrityError unless: free ids are unique, in range and exactly the bitmap's True
        entries; `_fresh` is sorted; the given-back count matches its arrays."""
        free = np.concatenate([self._fresh, *self._given])
        if self._num_given != sum(g.size for g in self._given):
            raise IntegrityError(f"the given-back {self.what} count drifted from its arrays")
        if free.size != np.unique(free).size:
            raise IntegrityError(f"{self.what} are on the free lists twice")
        if free.size and (free.min() < self.first or free.max() >= self.first + self.num_ids):
            raise IntegrityError(f"a free id of the {self.what} is out of range")
        if np.any(np.diff(self._fresh) <= 0):
            raise IntegrityError(f"the fresh {self.what} list must stay sorted")
        expected = np.zeros(self.num_ids, dtype=np.bool_)
        expected[free - self.first] = True
        if not np.array_equal(expected, self._is_free):
            raise IntegrityError(f"the free bitmap of {self.what} disagrees with the free lists")

    def _merge(self) -> None:
        # Sorting here (not on every give) keeps give O(n) and still hands out low, contiguous
        # ids once the fresh ones run out.
        self._fresh = np.sort(np.concatenate([self._fresh, *self._given]))
        self._given = []
        self._num_given = 0


def _repeats(offsets: IdArray, stamps: IdArray) -> bool:
    """Whether an offset appears twice. Ascending offsets (what the owners mostly give back)
    are distinct by one comparison; otherwise each offset stamps its position into `stamps`
    and reads it back: a repeated offset reads the later position at the earlier one. O(n),
    no sort (np.unique costs several times more on the few hundred ids of a free)."""
    n = offsets.size
    if n < 2 or bool((offsets[1:] > offsets[:-1]).all()):
        return False
    positions = np.arange(n, dtype=np.int64)
    stamps[offsets] = positions
    return not np.array_equal(stamps[offsets], positions)
