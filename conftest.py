"""Workspace-wide pytest setup: Hypothesis profiles and skipping CUDA tests without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvstrata.testkit import register_profiles

register_profiles()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
