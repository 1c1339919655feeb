"""ReqToTokenPool: which KV slots each running request's tokens occupy.

    req_to_token  int32 [size + 1, max_context_len]     row r, column t: KV slot of token t
                  row 0: padding (padded batch entries point here; always zeros)

Rows are handed out by `alloc` and returned by `free`; the free list lives on the host (a
`kvstrata.core.free_ids.FreeIds` over rows 1..size, the one host free-id list, shared with the
host tier's page allocator: ascending rows, a bitmap), so alloc and free never touch the device
table. Columns past a request's length hold whatever was there before: readers use the
request's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core.free_ids import FreeIds
from kvstrata.pool.base import check_distinct, check_index_tensor, resolve_device
from kvstrata.pool.errors import (
    IndexOutOfRange,
    InvalidArgument,
    ReservedIndex,
    RowNotAllocated,
)

Rows = torch.Tensor | Sequence[int] | int

_INT32_LIMIT = 2**31


class ReqToTokenPool:
    """`size` request rows (ids 1..size) of `max_context_len` token slots each, on `device`.

    Every argument is validated before anything changes. Row and start arguments are brought to
    the host for that (a sync when they live on a GPU), and `write` reads the extremes of the
    slots it writes.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        for name, value in (("size", size), ("max_context_len", max_context_len)):
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = resolve_device(device)
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=self.device
        )
        self._rows = FreeIds(size, first=1, what="rows")

    # --- description ---------------------------------------------------------------------------

    def available_size(self) -> int:
        """Rows free now."""
        return self._rows.num_free

    @property
    def num_used(self) -> int:
        """Rows allocated now."""
        return self.size - self._rows.num_free

    @property
    def size_bytes(self) -> int:
        """Bytes of the device table (row 0 included)."""
        return self.req_to_token.numel() * self.req_to_token.element_size()

    # --- rows ----------------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free rows (int64, on the device, ascending for a fresh pool), or None, changing
        nothing, when fewer than `n` are free. The rows stay the caller's until freed; their
        table contents are stale until written. `alloc(0)` returns an empty tensor."""
        if not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"alloc needs a non-negative int, got {n!r}")
        rows = self._rows.take(n)
        return None if rows is None else torch.from_numpy(rows).to(self.device)

    def free(self, rows: Rows) -> None:
        """Return `rows` to the free list (the table is not cleared). ReservedIndex for row 0,
        IndexOutOfRange outside 1..size, DoubleFree for a free row or one listed twice; on any
        of these nothing is freed. An empty list is a no-op."""
        r = self._host_rows(rows)
        if not r.numel():
            return
        self._check_rows(r)
        self._rows.give(r.numpy())

    def clear(self) -> None:
        """Free every row (the table keeps its contents; row 0 stays zero)."""
        self._rows.clear()

    # --- table ---------------------------------------------------------------------------------

    def write(
        self,
        rows: Rows,
        start: torch.Tensor | Sequence[int] | int,
        slots: torch.Tensor,
        *,
        lengths: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        """Write KV slots into allocated rows: row `rows[i]`, columns `start[i] ..
        start[i] + len_i - 1`, values the next `len_i` entries of `slots`.

        Lengths: one row takes all of 1-D `slots`; a 2-D `slots` `[B, m]` gives every row m;
        otherwise pass `lengths` (`[B]`, summing to `len(slots)`). `start` is an int for all
        rows or one per row. Rows must be allocated (RowNotAllocated) and distinct; columns
        inside the row (IndexOutOfRange); slots non-negative and below 2**31 (int32). Mutates
        those table cells only, after every check.
        """
        r = self._host_rows(rows)
        b = r.numel()
        slots = check_index_tensor(slots, what="slots", dims=None)
        lens = self._lengths(b, slots, lengths)
        starts = self._starts(start, b)
        self._check_rows(r)
        check_distinct(r, what="rows")
        allocated = torch.from_numpy(self._rows.allocated(r.numpy()))
        if not bool(allocated.all()):
            raise RowNotAllocated(f"rows {r[~allocated].tolist()} are not allocated")
        if b and (int(starts.min()) < 0 or int((starts + lens).max()) > self.max_context_len):
            raise IndexOutOfRange(
                f"columns must lie in [0, {self.max_context_len}); "
                f"starts {starts.tolist()}, lengths {lens.tolist()}"
            )
        flat = slots.reshape(-1)
        if not flat.numel():
            return
        lo, hi = torch.stack(list(torch.aminmax(flat))).tolist()
        if lo < 0 or hi >= _INT32_LIMIT:
            raise IndexOutOfRange(f"slots must lie in [0, 2**31); got min {lo}, max {hi}")
        values = flat.to(device=self.device, dtype=torch.int32)
        if b == 1:
            s = int(starts[0])
            self.req_to_token[int(r[0]), s : s + flat.numel()] = values
            return
        total = flat.numel()
        offsets = torch.cumsum(lens, 0) - lens
        row_idx = r.repeat_interleave(lens)
        col_idx = starts.repeat_interleave(lens) + (
            torch.arange(total, dtype=torch.int64) - offsets.repeat_interleave(lens)
        )
        self.req_to_token[row_idx.to(self.device), col_idx.to(self.device)] = values

    # --- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert (IntegrityError, an AssertionError): free rows are distinct, in 1..size and
        exactly the unallocated ones (row 0 is never on the list); row 0 all zeros. Reads the
        table's row 0 (a sync on CUDA)."""
        self._rows.check_integrity()
        assert self.req_to_token.shape == (self.size + 1, self.max_context_len), "table reshaped"
        assert not bool(self.req_to_token[0].any()), "row 0 (padding) was written"

    # --- argument parsing ----------------------------------------------------------------------

    def _host_rows(self, rows: Rows) -> torch.Tensor:
        if isinstance(rows, torch.Tensor):
            t = check_index_tensor(rows, what="rows", dims=None)
            if t.dim() > 1:
                raise InvalidArgument(f"rows must be 0-D or 1-D, got shape {tuple(t.shape)}")
            return t.reshape(-1).to(device="cpu", dtype=torch.int64)
        if isinstance(rows, int):
            return torch.tensor([rows], dtype=torch.int64)
        seq = list(rows)
        if not all(isinstance(x, int) for x in seq):
            raise InvalidArgument(f"rows must be ints, got {seq!r}")
        return torch.tensor(seq, dtype=torch.int64)

    def _check_rows(self, r: torch.Tensor) -> None:
        if not r.numel():
            return
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi > self.size:
            raise IndexOutOfRange(f"rows must lie in 1..{self.size}; got min {lo}, max {hi}")
        if lo == 0:
            raise ReservedIndex("row 0 is the padding row; it is never allocated or written")

    def _starts(self, start: torch.Tensor | Sequence[int] | int, b: int) -> torch.Tensor:
        if isinstance(start, int):
            return torch.full((b,), start, dtype=torch.int64)
        s = (
            check_index_tensor(start, what="start", dims=None).reshape(-1).to("cpu", torch.int64)
            if isinstance(start, torch.Tensor)
            else torch.tensor(list(start), dtype=torch.int64)
        )
        if s.numel() != b:
            raise InvalidArgument(f"{s.numel()} starts for {b} rows")
        return s

    def _lengths(
        self, b: int, slots: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None
    ) -> torch.Tensor:
        if lengths is not None:
            lens = (
                check_index_tensor(lengths, what="lengths").to("cpu", torch.int64)
                if isinstance(lengths, torch.Tensor)
                else torch.tensor(list(lengths), dtype=torch.int64)
            )
            if slots.dim() != 1 or lens.numel() != b or (b and int(lens.min()) < 0):
                raise InvalidArgument(
                    f"lengths must be {b} non-negative counts for 1-D slots; "
                    f"got {lens.tolist()} for slots of shape {tuple(slots.shape)}"
                )
            if int(lens.sum()) != slots.numel():
                raise InvalidArgument(
                    f"lengths sum to {int(lens.sum())} but there are {slots.numel()} slots"
                )
            return lens
        if slots.dim() == 2 and slots.shape[0] == b:
            return torch.full((b,), slots.shape[1], dtype=torch.int64)
        if slots.dim() == 1 and b == 1:
            return torch.tensor([slots.numel()], dtype=torch.int64)
        raise InvalidArgument(
            f"cannot split slots of shape {tuple(slots.shape)} over {b} rows: pass a 2-D "
            "[rows, m] tensor or lengths"
        )
