"""Preallocated arrays for the numpy engine's hot paths: work arrays (`Scratch`) and fresh output
arrays carved from large chunks (`OutputSlab`).

Why: in a serving loop (and in `kvstrata bench alloc`) a decode round runs right after work that
allocates and frees megabytes, and there the first `malloc` of the round costs 20-30 us, as much
as the rest of `alloc_decode` together (measured in the bench's decode round at page size 16:
`np.add(loc, 1)` 29-37 us with a fresh output, 5-6 us into a slab view).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

#: int64 entries per `OutputSlab` chunk (512 KiB): 256 decode rounds of a 256-request batch.
SLAB_CHUNK_ENTRIES = 1 << 16

#: Outputs larger than this get their own array: a chunk would be mostly wasted on them, and at
#: that size the malloc is a small share of the call.
SLAB_MAX_TAKE = SLAB_CHUNK_ENTRIES // 16


class Scratch:
    """Preallocated work arrays for the hot paths, so that a decode round allocates nothing but
    its output: after the caller has freed large arrays, the first `malloc` of a round can cost
    tens of microseconds, and numpy's temporaries would each pay part of that.

    `fit(n)` makes `a`, `b` (int64), `m32` (int32), `opens`, `bad`, `mis` (bool) views of `n`
    entries into buffers that only grow. Their contents are garbage between calls, and nothing
    handed to a caller may alias them.
    """

    __slots__ = ("_buffers", "a", "b", "bad", "m32", "mis", "n", "opens")

    def __init__(self) -> None:
        self.n = -1
        self._buffers: tuple[Ints, Ints, npt.NDArray[np.int32], Bools, Bools, Bools] = self._make(0)
        self.a, self.b, self.m32, self.opens, self.bad, self.mis = self._buffers

    @staticmethod
    def _make(cap: int) -> tuple[Ints, Ints, npt.NDArray[np.int32], Bools, Bools, Bools]:
        return (
            np.empty(cap, dtype=np.int64),
            np.empty(cap, dtype=np.int64),
            np.empty(cap, dtype=np.int32),
            np.empty(cap, dtype=np.bool_),
            np.empty(cap, dtype=np.bool_),
            np.empty(cap, dtype=np.bool_),
        )

    def fit(self, n: int) -> Scratch:
        if n != self.n:  # batch sizes repeat, so this is usually skipped
            if n > len(self._buffers[0]):
                self._buffers = self._make(max(n, 2 * len(self._buffers[0])))
            a, b, m32, opens, bad, mis = self._buffers
            self.a, self.b, self.m32 = a[:n], b[:n], m32[:n]
            self.opens, self.bad, self.mis = opens[:n], bad[:n], mis[:n]
            self.n = n
        return self


class OutputSlab:
    """Fresh int64 arrays for callers to keep, cut one after another from a preallocated chunk.

    `take(n)` returns an array no earlier `take` has returned any part of, so a caller may keep,
    write and pass on what it gets exactly as if it were `np.empty(n)`: views never overlap,
    and `torch.from_numpy` of one spans only its own entries. A chunk is replaced (not reused)
    when it runs out; it is freed once the last array cut from it is dropped, so one long-lived
    output holds at most one chunk (SLAB_CHUNK_ENTRIES * 8 bytes) alive. Chunks are written
    once when made, so the pages are faulted in then rather than inside a timed call.
    """

    __slots__ = ("_address", "_chunk", "_pos")

    def __init__(self) -> None:
        self._chunk: Ints = np.empty(0, dtype=np.int64)
        self._address = 0  # of the chunk's first entry
        self._pos = 0

    def take(self, n: int) -> Ints:
        return self.take_with_address(n)[0]

    def take_with_address(self, n: int) -> tuple[Ints, int]:
        """`take(n)` and the address of its first entry (for compiled callers)."""
        if n > SLAB_MAX_TAKE:
            big = np.empty(n, dtype=np.int64)
            return big, big.ctypes.data
        pos = self._pos
        end = pos + n
        if end > len(self._chunk):
            self._chunk = np.zeros(SLAB_CHUNK_ENTRIES, dtype=np.int64)
            self._chunk.fill(0)  # np.zeros maps lazily: touch every page now
            self._address = self._chunk.ctypes.data
            pos, end = 0, n
        self._pos = end
        return self._chunk[pos:end], self._address + 8 * pos
