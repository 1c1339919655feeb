"""Fixtures shared by this package's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test (restored after): small torch ops on 2 shared cores are
    slow and erratic with two OpenMP threads. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
