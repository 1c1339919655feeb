"""Ray reads some settings when it is imported: set them before any test module imports it, so
every Ray socket binds to loopback and nothing is written under ~/.ray (RAY_NOTES.md)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Under `uv run`, Ray 2.60 otherwise ships the working tree to every worker and starts each
# worker with `uv run` in a fresh copy (a new venv without bytecode): actors then take minutes
# to start on a loaded machine, past every timeout.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
