"""Ray reads some settings when it is imported: set them before any test module imports it, so
every Ray socket binds to loopback and nothing is written under ~/.ray (RAY_NOTES.md)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Under `uv run`, Ray would start every worker with `uv run` too and ship the working tree to
# the cluster; the workers already run in this interpreter's environment.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
