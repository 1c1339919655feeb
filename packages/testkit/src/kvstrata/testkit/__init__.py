"""Shared test support for the kvstrata workspace (private; never uploaded)."""

from __future__ import annotations

from kvstrata.testkit.hypothesis_profiles import register_profiles
from kvstrata.testkit.workspace import WORKSPACE_ROOT, member_dirs

__all__ = ["WORKSPACE_ROOT", "member_dirs", "register_profiles"]
