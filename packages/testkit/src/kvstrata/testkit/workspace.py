"""Where the workspace is on disk, for tests that inspect the repository itself."""

from __future__ import annotations

from pathlib import Path


def _find_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "uv.lock").is_file() and (parent / "packages").is_dir():
            return parent
    raise RuntimeError(f"no workspace root (a folder with uv.lock and packages/) above {here}")


WORKSPACE_ROOT: Path = _find_root()


def member_dirs() -> list[Path]:
    """Every workspace member folder (packages/* and services/* with a pyproject.toml)."""
    found = [
        p.parent
        for pattern in ("packages/*/pyproject.toml", "services/*/pyproject.toml")
        for p in WORKSPACE_ROOT.glob(pattern)
    ]
    return sorted(found)
