"""The import-linter contracts of the root pyproject.toml bite.

Each test copies the sources of every member into a temporary tree, optionally plants one
forbidden import, and runs `lint-imports` on that copy alone (the installed editable paths are
kept off `sys.path`, so the copy is what gets analysed).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from kvstrata.testkit import WORKSPACE_ROOT, member_dirs

_RUNNER = """
import sys
sys.path[:0] = {paths!r}
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename={config!r}))
"""


def _copy_sources(dest: Path) -> Path:
    """Merge every member's src/kvstrata into dest/kvstrata (a namespace package)."""
    for member in member_dirs():
        src = member / "src" / "kvstrata"
        if src.is_dir():
            shutil.copytree(src, dest / "kvstrata", dirs_exist_ok=True)
    assert not (dest / "kvstrata" / "__init__.py").exists(), "kvstrata must stay a namespace"
    return dest / "kvstrata"


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    site_packages = sysconfig.get_paths()["purelib"]
    code = _RUNNER.format(
        paths=[str(tree), site_packages], config=str(WORKSPACE_ROOT / "pyproject.toml")
    )
    # -S: no site processing, so the editable .pth files of the real workspace are not read.
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        cwd=tree,
        timeout=120,
    )


def test_clean_tree_passes(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        # a pool (bottom layer) reaching up to its allocator
        ("pool", "import kvstrata.allocator\n", "Layers never import upward"),
        # siblings on one line must stay independent
        ("allocator", "import kvstrata.pool_host\n", "Layers never import upward"),
        # a layer importing ray
        ("storage", "import ray\n", "Only the Ray services import ray"),
    ],
)
def test_planted_import_is_reported(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    package = _copy_sources(tmp_path)
    init = package / module / "__init__.py"
    init.write_text(init.read_text() + "\n" + planted)
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert contract in result.stdout
    assert "BROKEN" in result.stdout


def test_unplaced_subpackage_is_reported(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    (package / "stray").mkdir()
    (package / "stray" / "__init__.py").write_text("")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "kvstrata.stray" in result.stdout + result.stderr


def _layer_index() -> dict[str, int]:
    """Each subpackage of kvstrata -> its line in the layers contract (0 = top)."""
    config = tomllib.loads((WORKSPACE_ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return {
        name.strip().strip("()"): i for i, line in enumerate(layers) for name in line.split("|")
    }


def _imported_subpackages(path: Path) -> set[str]:
    """The kvstrata subpackages a file imports (any import statement, at any depth)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "kvstrata":
                names = [f"kvstrata.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("kvstrata.")}
    return found


def test_member_tests_import_only_their_member_the_layers_below_and_the_testkit() -> None:
    """A member's tests run against what the member declares: its own subpackages, the
    layers strictly below its lowest one (not a sibling on the same line), and the testkit."""
    index = _layer_index()
    wrong: list[str] = []
    for member in member_dirs():
        own = {p.name for p in (member / "src" / "kvstrata").iterdir() if p.is_dir()}
        own.discard("__pycache__")
        if own == {"testkit"} or not (member / "tests").is_dir():
            continue
        floor = max(index[name] for name in own)
        for path in sorted((member / "tests").rglob("*.py")):
            where = path.relative_to(WORKSPACE_ROOT)
            wrong += [
                f"{where} imports kvstrata.{name}"
                for name in sorted(_imported_subpackages(path) - own - {"testkit"})
                if index[name] <= floor
            ]
    assert not wrong, "\n".join(wrong)
