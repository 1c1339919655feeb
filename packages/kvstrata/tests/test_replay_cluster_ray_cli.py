"""`kvstrata replay --instances 2 --ray` from the command line, without `--address`: the CLI
starts its own loopback Ray cluster, runs every instance as an actor beside the L3 stores and
index shards, shuts it all down, and reports exactly what the in-process run reports (round
robin on the same arrivals routes alike). Lives here, not in services/replay-ray, because it
drives the CLI, the layer above that member."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstrata.cli.main import main

# Ray's uv hook would ship this tree to every worker under `uv run` (see RAY_NOTES / .ci/run).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_ray_round_robin_equals_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--limit", "30", "--capacity-tokens", "1920"]
    argv += ["--instances", "2", "--router", "round-robin", "--no-progress"]
    assert main([*argv, "--json", str(tmp_path / "local.json")]) == 0
    assert main([*argv, "--ray", "--json", str(tmp_path / "ray.json")]) == 0
    assert "Ray actors" in capsys.readouterr().out
    local = json.loads((tmp_path / "local.json").read_text())
    on_ray = json.loads((tmp_path / "ray.json").read_text())
    assert on_ray.pop("backend") == "RayCluster" and local.pop("backend") == "LocalCluster"
    assert on_ray == local
    assert local["hit_pages"] > 0
