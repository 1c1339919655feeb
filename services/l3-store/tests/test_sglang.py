"""The SGLang adapter against the real SGLang 0.5.23 code, in the peer venv that
`shared/bench/peer/setup.sh` builds (SGLang without its GPU dependencies). The venv is a CI
prerequisite (`.ci/run` runs setup.sh first): without it this test fails, it does not skip.

Our sources go on PYTHONPATH (every member's src), with msgpack, xxhash and
prometheus_client linked from this workspace's venv (the peer venv lacks them; all are
pure or built for the same CPython 3.11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.testkit.workspace import WORKSPACE_ROOT

PEER_VENV = Path(os.environ.get("PEER_VENV", "/tmp/kvstrata-peer"))
PEER_DIR = WORKSPACE_ROOT.parent / "shared" / "bench" / "peer"
SCRIPT = Path(__file__).with_name("sglang_roundtrip.py")


def _site_packages() -> Path:
    import msgpack

    return Path(msgpack.__file__).parent.parent


def _run(urls: list[str], shim: Path) -> list[dict[str, object]]:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no SGLang peer venv at {PEER_VENV}: run `bash {PEER_DIR}/setup.sh` first")
    for name in ("msgpack", "xxhash", "prometheus_client"):
        link = shim / name
        if not link.exists():
            link.symlink_to(_site_packages() / name)
    # Every member's sources: the adapter imports storage, which imports the layers below it.
    members = sorted(WORKSPACE_ROOT.glob("packages/*/src")) + sorted(
        WORKSPACE_ROOT.glob("services/*/src")
    )
    path = [shim, *members]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    done = subprocess.run(
        [str(python), str(SCRIPT), " ".join(urls), str(PEER_DIR)],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(urls) :]]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """One peer process (importing SGLang costs seconds) runs the round trip for both URLs."""
    tmp = tmp_path_factory.mktemp("sglang")
    (tmp / "shim").mkdir()
    (tmp / "pages").mkdir()
    urls = {"memory": "memory://?capacity_bytes=16MiB",
            "file": f"file://{tmp / 'pages'}?capacity_bytes=16MiB"}  # fmt: skip
    return dict(zip(urls, _run(list(urls.values()), tmp / "shim"), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_sglang_factory_loads_adapter_and_pages_round_trip(
    outcomes: dict[str, dict[str, object]], scheme: str
) -> None:
    out = outcomes[scheme]
    assert out["class"] == "KvstrataHiCacheStorage"
    assert out["exists_before"] == 0
    assert out["set"] == [True] * 5
    assert out["exists_after"] == 5 and out["exists_gap"] == 2
    assert out["get"] == [True] * 5 and out["identical"] == [True] * 5 and out["distinct"]
    assert out["missing_get"] == [False]
    assert out["set_one"] and out["get_one"] and out["exists_one"]
    assert out["stats"] == {"prefetch_pgs": [5, 0], "backup_pgs": [5]}
    assert out["exists_cleared"] == 0
    assert sys.version_info[:2] == (3, 11), "the peer venv's wheels are cp311, like ours"
