"""ReqToTokenPool: row allocation, bounds-checked writes, and a stateful model test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.pool import (
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidArgument,
    ReqToTokenPool,
    ReservedIndex,
    RowNotAllocated,
)
from kvstrata.testkit.pools import make_req_to_token_pool


def test_alloc_free_cycle(device: str) -> None:
    pool = make_req_to_token_pool(size=4, device=device)
    assert pool.req_to_token.shape == (5, 16) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert rows is not None and rows.tolist() == [1, 2, 3] and rows.device == pool.device
    assert pool.available_size() == 1 and pool.num_used == 3
    assert pool.alloc(2) is None, "not enough rows"
    assert pool.available_size() == 1, "a failed alloc changed nothing"
    pool.free(rows[1:])
    again = pool.alloc(2)
    assert again is not None and again.tolist() == [2, 3], "freed rows come back in order"
    empty = pool.alloc(0)
    assert empty is not None and empty.numel() == 0
    pool.check_integrity()
    pool.clear()
    assert pool.available_size() == 4
    pool.check_integrity()


def test_free_errors_change_nothing() -> None:
    pool = make_req_to_token_pool(size=4)
    rows = pool.alloc(2)
    assert rows is not None
    for bad, error in [
        ([0], ReservedIndex),
        ([5], IndexOutOfRange),
        ([-1], IndexOutOfRange),
        ([3], DoubleFree),  # never allocated
        ([1, 1], DoubleFree),  # listed twice
        ([1, 3], DoubleFree),  # one good, one free: neither is freed
        (torch.tensor([1.0]), InvalidArgument),
    ]:
        with pytest.raises(error):
            pool.free(bad)
        assert pool.available_size() == 2
        pool.check_integrity()
    pool.free(1)
    with pytest.raises(DoubleFree):
        pool.free(torch.tensor(1))
    pool.free([])
    with pytest.raises(InvalidArgument):
        pool.alloc(-1)


def test_write_single_batched_and_ragged(device: str) -> None:
    pool = make_req_to_token_pool(size=4, max_context_len=8, device=device)
    rows = pool.alloc(3)
    assert rows is not None
    t = pool.req_to_token
    pool.write(int(rows[0]), 2, torch.tensor([10, 11, 12], device=device))
    assert t[1].tolist() == [0, 0, 10, 11, 12, 0, 0, 0]
    pool.write(rows[1:], torch.tensor([0, 6]), torch.tensor([[20, 21], [30, 31]]))
    assert t[2, :2].tolist() == [20, 21] and t[3, 6:].tolist() == [30, 31]
    pool.write(rows, [5, 0, 3], torch.tensor([1, 2, 3, 4, 5, 6]), lengths=[3, 0, 3])
    assert t[1, 5:].tolist() == [1, 2, 3] and t[3, 3:6].tolist() == [4, 5, 6]
    assert t[2, :2].tolist() == [20, 21], "a zero-length write touched its row"
    pool.check_integrity()


def test_write_errors_change_nothing() -> None:
    pool = make_req_to_token_pool(size=4, max_context_len=8)
    rows = pool.alloc(2)
    assert rows is not None
    snapshot = pool.req_to_token.clone()
    bad = [
        ((3, 0, torch.tensor([1])), RowNotAllocated),
        ((0, 0, torch.tensor([1])), ReservedIndex),
        ((9, 0, torch.tensor([1])), IndexOutOfRange),
        ((1, 6, torch.tensor([1, 2, 3])), IndexOutOfRange),  # past max_context_len
        ((1, -1, torch.tensor([1])), IndexOutOfRange),
        ((1, 0, torch.tensor([-5])), IndexOutOfRange),  # a negative slot
        ((1, 0, torch.tensor([2**31])), IndexOutOfRange),  # does not fit int32
        ((1, 0, torch.tensor([1.5])), InvalidArgument),
        ((rows, 0, torch.tensor([1, 2, 3])), InvalidArgument),  # 2 rows, 1-D, no lengths
        ((rows, [0, 1, 2], torch.tensor([[1], [2]])), InvalidArgument),  # 3 starts
        ((torch.tensor([1, 1]), 0, torch.tensor([[1], [2]])), DuplicateIndex),
    ]
    for (r, start, slots), error in bad:
        with pytest.raises(error):
            pool.write(r, start, slots)
    with pytest.raises(InvalidArgument):
        pool.write(rows, 0, torch.tensor([1, 2, 3]), lengths=[1, 1])  # lengths sum 2, not 3
    assert torch.equal(pool.req_to_token, snapshot)
    pool.check_integrity()


class ReqToTokenMachine(RuleBasedStateMachine):
    """Random allocs, frees and writes (valid and invalid) against a model of the rows."""

    SIZE, CONTEXT = 6, 5

    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(self.SIZE, self.CONTEXT)
        self.allocated: set[int] = set()
        self.table = torch.zeros((self.SIZE + 1, self.CONTEXT), dtype=torch.int32)

    @rule(n=st.integers(0, 4))
    def alloc(self, n: int) -> None:
        rows = self.pool.alloc(n)
        if n > self.SIZE - len(self.allocated):
            assert rows is None
            return
        assert rows is not None and rows.numel() == n
        got = set(rows.tolist())
        assert len(got) == n and not got & self.allocated and got <= set(range(1, self.SIZE + 1))
        self.allocated |= got

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.allocated)), unique=True))
        self.pool.free(torch.tensor(rows, dtype=torch.int64))
        self.allocated -= set(rows)

    @rule(row=st.integers(-1, 7), twice=st.booleans())
    def bad_free(self, row: int, twice: bool) -> None:
        rows = [row, row] if twice else [row]
        if not twice and row in self.allocated:
            return
        with pytest.raises((DoubleFree, ReservedIndex, IndexOutOfRange)):
            self.pool.free(rows)

    @rule(
        row=st.integers(-1, 7),
        start=st.integers(-1, 5),
        slots=st.lists(st.integers(0, 1000), min_size=1, max_size=5),
    )
    def write(self, row: int, start: int, slots: list[int]) -> None:
        ok = row in self.allocated and start >= 0 and start + len(slots) <= self.CONTEXT
        values = torch.tensor(slots, dtype=torch.int64)
        if not ok:
            with pytest.raises((RowNotAllocated, ReservedIndex, IndexOutOfRange)):
                self.pool.write(row, start, values)
            return
        self.pool.write(row, start, values)
        self.table[row, start : start + len(slots)] = values.to(torch.int32)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert self.pool.available_size() == self.SIZE - len(self.allocated)
        for row in self.allocated:
            assert torch.equal(self.pool.req_to_token[row], self.table[row])


TestReqToTokenMachine = ReqToTokenMachine.TestCase
