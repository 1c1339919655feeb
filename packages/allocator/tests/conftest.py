"""Fixtures shared by this package's tests."""

from __future__ import annotations

import pytest

from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each array backend in turn (a test taking `backend` runs once per backend)."""
    return request.param
