"""Every layer that raises a shared error re-exports the one class of kvstrata.core.errors (not a
copy), so `except DoubleFree` imported from any layer catches it from every layer. Lives in the
testkit's tests because it imports every lower layer."""

from __future__ import annotations

import importlib

import pytest

from kvstrata.core import errors as core

# (member errors module, the shared names it re-exports)
REEXPORTS = [
    (
        "kvstrata.allocator.errors",
        (
            "DoubleFree",
            "DuplicateIndex",
            "IndexOutOfRange",
            "IntegrityError",
            "MisalignedIndex",
            "NotAllocated",
            "ReservedIndex",
        ),
    ),
    ("kvstrata.pool.errors", ("DoubleFree", "DuplicateIndex", "IndexOutOfRange", "ReservedIndex")),
    (
        "kvstrata.pool_host.errors",
        (
            "BufferSizeMismatch",
            "DoubleFree",
            "DuplicateIndex",
            "IndexOutOfRange",
            "LayerLoadFailed",
            "MisalignedIndex",
            "ReservedIndex",
        ),
    ),
    ("kvstrata.storage.errors", ("BufferSizeMismatch",)),
    ("kvstrata.hybrid_cache.errors", ("LayerLoadFailed",)),
]


@pytest.mark.parametrize(("module", "names"), REEXPORTS, ids=[m for m, _ in REEXPORTS])
def test_members_reexport_the_one_class(module: str, names: tuple[str, ...]) -> None:
    errors = importlib.import_module(module)
    for name in names:
        assert getattr(errors, name) is getattr(core, name), f"{module}.{name} is a copy"
        assert name in errors.__all__


def test_one_except_catches_every_layer() -> None:
    from kvstrata.allocator.errors import DoubleFree as AllocatorDoubleFree
    from kvstrata.pool.errors import DoubleFree as PoolDoubleFree
    from kvstrata.pool_host.errors import DoubleFree as HostDoubleFree

    for raised in (AllocatorDoubleFree, PoolDoubleFree, HostDoubleFree):
        with pytest.raises(core.DoubleFree):
            raise raised("freed twice")


def test_layer_specific_subclasses_keep_both_families() -> None:
    from kvstrata.pool.errors import PoolError, RowNotAllocated
    from kvstrata.pool_host.errors import InvalidIndices, NonIntegerIndex

    assert issubclass(RowNotAllocated, PoolError)
    assert issubclass(RowNotAllocated, core.NotAllocated)
    assert issubclass(NonIntegerIndex, InvalidIndices)
    assert issubclass(NonIntegerIndex, core.MisalignedIndex)
