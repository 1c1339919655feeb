"""The testkit finds the workspace and loads the Hypothesis profile the suite relies on."""

from __future__ import annotations

import hypothesis

from kvstrata.testkit import WORKSPACE_ROOT, member_dirs


def test_workspace_root_is_the_repository() -> None:
    assert (WORKSPACE_ROOT / "uv.lock").is_file()
    assert (WORKSPACE_ROOT / ".ci" / "run").is_file()


def test_member_dirs_lists_each_member_once() -> None:
    members = member_dirs()
    assert len(members) == len(set(members))
    assert all((m / "pyproject.toml").is_file() for m in members)
    assert WORKSPACE_ROOT / "packages" / "testkit" in members


def test_ci_profile_is_loaded_without_deadline() -> None:
    # The root conftest.py loads the "ci" profile unless HYPOTHESIS_PROFILE says otherwise.
    current = hypothesis.settings()
    assert current.deadline is None
    assert current.max_examples in (60, 600)
