"""FreeIds: exact ids handed out, every refusal leaves the list unchanged, and a stateful model
check with check_integrity() after every step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.core.errors import DoubleFree, IndexOutOfRange, IntegrityError
from kvstrata.core.free_ids import FreeIds


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_fresh_ids_first_then_given_back_ones_sorted() -> None:
    free = FreeIds(6, first=1, what="rows")
    a = free.take(3)
    assert a is not None and a.tolist() == [1, 2, 3]
    free.give(ids(3, 1))
    b = free.take(3)  # the fresh ones suffice: 4, 5, 6
    assert b is not None and b.tolist() == [4, 5, 6]
    c = free.take(2)  # now the given-back ones, merged in order
    assert c is not None and c.tolist() == [1, 3]
    assert free.num_free == 0 and free.take(1) is None
    assert free.take(0) is not None
    free.check_integrity()


def test_the_returned_array_is_the_callers() -> None:
    free = FreeIds(4)
    given = ids(0, 1)
    assert free.take(4) is not None
    free.give(given)
    given[:] = 3  # the caller reuses its array
    out = free.take(2)
    assert out is not None and out.tolist() == [0, 1]
    free.check_integrity()


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (ids(0), IndexOutOfRange, r"rows must lie in \[1, 5\)"),
        (ids(5), IndexOutOfRange, r"rows must lie in \[1, 5\)"),
        (ids(2, 2), DoubleFree, "listed twice"),
        (ids(3, 1, 3), DoubleFree, "listed twice"),  # not adjacent, not ascending
        (ids(2, 3, 1, 2), DoubleFree, "listed twice"),
        (ids(3, 2, 2, 4), DoubleFree, "listed twice"),  # a repeat comes before already-free
        (ids(1, 4), DoubleFree, r"rows \[4\] are already free"),
    ],
)
def test_bad_gives_change_nothing(bad: np.ndarray, error: type[Exception], match: str) -> None:
    free = FreeIds(4, first=1, what="rows")
    assert free.take(3) is not None  # rows 1..3 handed out, 4 free
    with pytest.raises(error, match=match):
        free.give(bad)
    assert free.num_free == 1 and free.allocated(ids(1, 2, 3, 4)).tolist() == [1, 1, 1, 0]
    free.check_integrity()


def test_distinct_ids_in_any_order_are_taken_back() -> None:
    """The repeat check stamps positions into scratch: stale stamps from an earlier give must
    not make distinct ids look repeated, whatever their order."""
    free = FreeIds(6)
    assert free.take(6) is not None
    free.give(ids(4, 1, 5))
    free.give(ids(3, 0, 2))  # stamps of the previous give still lie in the scratch
    assert free.num_free == 6
    free.check_integrity()


def test_a_corrupt_list_is_an_integrity_error_not_a_double_handout() -> None:
    free = FreeIds(4)
    assert free.take(1) is not None
    free._fresh = ids(0, 1, 2, 3)  # a bug outside put a handed-out id back behind the bitmap
    with pytest.raises(IntegrityError, match="corrupt"):
        free.take(1)
    with pytest.raises(IntegrityError):
        free.check_integrity()


def test_clear_and_negative_range() -> None:
    free = FreeIds(3)
    assert free.take(3) is not None
    free.clear()
    assert free.num_free == 3
    free.check_integrity()
    with pytest.raises(IndexOutOfRange):
        FreeIds(-1)


class FreeIdsMachine(RuleBasedStateMachine):
    """The list against a set model: same free count, ids never handed out twice."""

    def __init__(self) -> None:
        super().__init__()
        self.free = FreeIds(12, first=3, what="ids")
        self.held: set[int] = set()

    @rule(n=st.integers(0, 14))
    def take(self, n: int) -> None:
        out = self.free.take(n)
        if n > 12 - len(self.held):
            assert out is None
            return
        assert out is not None and len(out) == n
        assert not self.held & set(out.tolist()) and len(set(out.tolist())) == n
        self.held |= set(out.tolist())

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.free.give(np.array(chosen, dtype=np.int64))
        self.held -= set(chosen)

    @rule(i=st.integers(0, 16))
    def give_free_or_outside(self, i: int) -> None:
        if i in self.held:
            return
        with pytest.raises((DoubleFree, IndexOutOfRange)):
            self.free.give(ids(i))

    @rule()
    def clear(self) -> None:
        self.free.clear()
        self.held.clear()

    @invariant()
    def consistent(self) -> None:
        self.free.check_integrity()
        assert self.free.num_free == 12 - len(self.held)


TestFreeIdsMachine = FreeIdsMachine.TestCase
