"""Every member is a real distribution: its wheel carries its own version and dependencies."""

from __future__ import annotations

import email
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvstrata.cli.main import DISTRIBUTIONS, main
from kvstrata.testkit import WORKSPACE_ROOT, member_dirs

MEMBERS = member_dirs()


def _project(member: Path) -> dict[str, object]:
    with (member / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]


def _req(text: str) -> tuple[str, frozenset[str]]:
    req = Requirement(text)
    return (req.name, frozenset(str(s) for s in req.specifier))


def test_every_member_has_readme_changelog_and_sources() -> None:
    assert {m.name for m in MEMBERS} >= {
        "pool",
        "pool-host",
        "allocator",
        "hybrid-cache",
        "storage",
        "unified-radix-cache",
        "kvstrata",
        "testkit",
    }
    for member in MEMBERS:
        assert (member / "README.md").is_file(), member
        assert (member / "CHANGELOG.md").is_file(), member
        assert (member / "tests").is_dir(), member
        version = str(_project(member)["version"])
        assert f"## {version}" in (member / "CHANGELOG.md").read_text(), (
            f"{member.name}: CHANGELOG.md has no entry for version {version}"
        )


def test_no_namespace_init() -> None:
    for member in MEMBERS:
        assert not (member / "src" / "kvstrata" / "__init__.py").exists(), member


def test_every_sibling_dependency_is_a_workspace_source() -> None:
    with (WORKSPACE_ROOT / "pyproject.toml").open("rb") as f:
        sources = tomllib.load(f)["tool"]["uv"]["sources"]
    names = {str(_project(m)["name"]) for m in MEMBERS}
    assert names == set(sources), "one [tool.uv.sources] entry per member, no more"


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")
@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_wheel_metadata(member: Path, tmp_path: Path) -> None:
    project = _project(member)
    subprocess.run(
        ["uv", "build", "--wheel", "--package", str(project["name"]), "-o", str(tmp_path)],
        cwd=WORKSPACE_ROOT,
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
        names = zf.namelist()
    assert meta["Version"] == project["version"]
    declared = {_req(str(d)) for d in project.get("dependencies", [])}  # type: ignore[union-attr]
    assert {_req(d) for d in meta.get_all("Requires-Dist") or []} == declared
    assert not any(n == "kvstrata/__init__.py" for n in names), "namespace package broken"


def test_cli_version_lists_every_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(DISTRIBUTIONS)
    # Each distribution reports the version its pyproject declares (bumped per change).
    declared = {str(_project(m)["name"]): str(_project(m)["version"]) for m in member_dirs()}
    assert all(line.split()[1] == declared[line.split()[0]] for line in out)
