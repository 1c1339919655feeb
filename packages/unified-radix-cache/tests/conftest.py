"""Fixtures shared by this package's hierarchical-cache tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ParamSpec, Protocol

import pytest

from kvstrata.testkit.tiers import Hierarchy, Shape, make_hierarchy, serve

_P = ParamSpec("_P")


class _Controller(Protocol):
    def close(self, timeout_s: float | None = None) -> bool: ...


class _Cache(Protocol):
    @property
    def controller(self) -> _Controller: ...


class _Built(Protocol):
    @property
    def cache(self) -> _Cache: ...


@pytest.fixture
def closing() -> Iterator[list[_Built]]:
    """Hierarchies a test builds (testkit's make_*hierarchy): each test appends what it makes,
    and every tier controller is closed (its worker threads stopped) when the test ends."""
    made: list[_Built] = []
    yield made
    for h in made:
        h.cache.controller.close()


def _closed_at_teardown(
    make: Callable[_P, Hierarchy], closing: list[_Built]
) -> Callable[_P, Hierarchy]:
    def build(*args: _P.args, **kwargs: _P.kwargs) -> Hierarchy:
        h = make(*args, **kwargs)
        closing.append(h)
        return h

    return build


@pytest.fixture
def hierarchy(closing: list[_Built]) -> Callable[..., Hierarchy]:
    """testkit's `make_hierarchy` (same arguments: shape first, page size 4 by default) whose
    hierarchies are closed when the test ends (through `closing`)."""
    return _closed_at_teardown(make_hierarchy, closing)


@pytest.fixture
def offloaded(hierarchy: Callable[..., Hierarchy]) -> Callable[..., tuple[Hierarchy, list[int]]]:
    """`offloaded(shape, pages, **make_hierarchy_kwargs)`: a hierarchy (through `hierarchy`)
    that served the prefix of `pages` pages of tokens 1, 2, ... (written through to the host)
    and then evicted every device page; returns it and that prefix, now on the host only."""

    def build(shape: Shape, pages: int, **kwargs: object) -> tuple[Hierarchy, list[int]]:
        h = hierarchy(shape, **kwargs)
        prefix = list(range(1, pages * h.tiers.page_size + 1))
        serve(h, prefix)
        h.cache.evict_device(h.tree.evictable_size())
        return h, prefix

    return build
