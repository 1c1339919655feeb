"""The root `[tool.basedpyright] include` names every member's src folder.

A "*" glob there once matched nothing, so the type check analysed 0 files without failing.
"""

from __future__ import annotations

import tomllib

from kvstrata.testkit import WORKSPACE_ROOT, member_dirs


def _include() -> list[str]:
    with (WORKSPACE_ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["tool"]["basedpyright"]["include"])


def test_include_lists_every_member_src_folder() -> None:
    wanted = {
        (m / "src").relative_to(WORKSPACE_ROOT).as_posix()
        for m in member_dirs()
        if (m / "src").is_dir()
    }
    assert wanted, "no member src folders found"
    missing = wanted - set(_include())
    assert not missing, f"[tool.basedpyright] include misses {sorted(missing)}"


def test_include_entries_are_existing_folders_without_globs() -> None:
    for entry in _include():
        assert not any(c in entry for c in "*?["), f"glob in include: {entry!r}"
        assert (WORKSPACE_ROOT / entry).is_dir(), f"include names a missing folder: {entry!r}"
