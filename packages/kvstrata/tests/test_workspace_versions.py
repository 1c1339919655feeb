"""Every dependency of one workspace member on another admits the version that member has now.
uv resolves workspace members from their folders whatever the constraint says, so a stale
`<0.2` on a member at 0.3.0 passes every local check and breaks the first install from an
index; this test is what notices."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from kvstrata.testkit import member_dirs


def _members() -> dict[str, tuple[Version, list[str]]]:
    out: dict[str, tuple[Version, list[str]]] = {}
    for folder in member_dirs():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        deps = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            deps += extra
        out[canonicalize_name(project["name"])] = (Version(project["version"]), deps)
    return out


def test_member_constraints_admit_the_members_versions() -> None:
    members = _members()
    assert len(members) >= 10, "the workspace lists its members"
    stale = []
    for name, (_, deps) in members.items():
        for dep in deps:
            req = Requirement(dep)
            dep_name = canonicalize_name(req.name)
            if dep_name in members:
                version = members[dep_name][0]
                if not req.specifier.contains(version, prereleases=True):
                    stale.append(f"{name}: {dep} excludes {dep_name} {version}")
    assert not stale, "\n".join(stale)
