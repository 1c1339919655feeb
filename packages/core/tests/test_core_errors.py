"""The shared error classes derive from the builtins the layers' old classes derived from, so
generic handlers keep catching them. (That each layer re-exports the one class, not a copy:
packages/testkit/tests/test_testkit_shared_errors.py, which may import every layer.)"""

from __future__ import annotations

import pytest

from kvstrata.core import errors as core


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (core.IndexOutOfRange, IndexError),
        (core.ReservedIndex, ValueError),
        (core.MisalignedIndex, ValueError),
        (core.DuplicateIndex, ValueError),
        (core.DoubleFree, core.NotAllocated),
        (core.NotAllocated, ValueError),
        (core.BufferSizeMismatch, ValueError),
        (core.LayerLoadFailed, RuntimeError),
        (core.IntegrityError, AssertionError),
    ],
)
def test_builtin_bases(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, builtin)
    with pytest.raises(builtin):
        raise cls("x")
