"""Workspace-wide pytest setup: Ray's import-time settings, Hypothesis profiles and skipping
CUDA tests without a GPU."""

from __future__ import annotations

import os

# Ray reads these when it is imported, and some test module imports it at collection (before
# the services' own conftests run): every Ray socket on 127.0.0.1, nothing under ~/.ray, and no
# uv hook shipping this tree to each worker (RAY_NOTES.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

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
