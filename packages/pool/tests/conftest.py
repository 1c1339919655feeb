"""Fixtures shared by this package's tests."""

from __future__ import annotations

import pytest

from kvstrata.testkit.pools import DEVICES


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each device in turn: the CPU, and CUDA (marked `cuda`: skipped without a GPU)."""
    return request.param
