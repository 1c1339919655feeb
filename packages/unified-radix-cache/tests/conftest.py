"""Fixtures shared by this package's hierarchical-cache tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import pytest


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
