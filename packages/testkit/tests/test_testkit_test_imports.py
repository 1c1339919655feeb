"""The lower layers' test suites import only their own member, the members it declares (directly
or through them) and the testkit: a member's tests must run with what its wheel depends on.

"Lower layers" are those below `unified_radix_cache` in the root layers contract (read from the
root pyproject.toml, so a member placed there later is checked too).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from kvstrata.testkit import WORKSPACE_ROOT, member_dirs


def _layers() -> list[str]:
    with (WORKSPACE_ROOT / "pyproject.toml").open("rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    names: list[str] = []
    for line in layers:
        names += [part.strip().strip("()") for part in line.split("|")]
    return names


def _members() -> dict[str, Path]:
    """Import name (`pool_host`) -> member folder, for the members with `src/kvstrata/<name>`."""
    found: dict[str, Path] = {}
    for member in member_dirs():
        for sub in (member / "src" / "kvstrata").glob("*/__init__.py"):
            found[sub.parent.name] = member
    return found


def _declared(member: Path) -> set[str]:
    """Import names of the kvstrata members `member` depends on, transitively."""
    by_dist = {f"kvstrata-{m.name}": name for name, m in _members().items()}
    seen: set[str] = set()
    todo = [member]
    while todo:
        with (todo.pop() / "pyproject.toml").open("rb") as f:
            deps = tomllib.load(f)["project"].get("dependencies", [])
        for dep in deps:
            dist = dep.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
            name = by_dist.get(dist)
            if name is not None and name not in seen:
                seen.add(name)
                todo.append(_members()[name])
    return seen


def _lower_members() -> list[str]:
    layers = _layers()
    members = _members()
    below = layers[layers.index("unified_radix_cache") + 1 :]
    return [name for name in below if name in members]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "kvstrata" and len(parts) > 1:
                names.add(parts[1])
    return names


def test_the_lower_layers_are_found() -> None:
    assert {"pool", "storage", "allocator", "pool_host", "hybrid_cache"} <= set(_lower_members())


@pytest.mark.parametrize("name", _lower_members())
def test_tests_import_only_declared_members(name: str) -> None:
    member = _members()[name]
    allowed = {name, "testkit"} | _declared(member)
    strays = {
        str(path.relative_to(WORKSPACE_ROOT)): sorted(_imported(path) - allowed)
        for path in sorted((member / "tests").rglob("*.py"))
    }
    assert not {k: v for k, v in strays.items() if v}, f"undeclared imports (allowed {allowed})"
