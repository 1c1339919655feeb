"""`kvstrata bench radix` beside the SGLang peer, run as a user runs it: a trace path relative to
the working directory (the peer script runs from its own folder, so the path must be resolved
before it is handed over). The peer venv is a CI prerequisite (`.ci/run` runs setup.sh): without
it this test fails, it does not skip. Figures are printed, never asserted; hit rates are, since
both trees run LRU over the same blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvstrata.bench import radix
from kvstrata.testkit.workspace import WORKSPACE_ROOT

PEER_VENV = Path(os.environ.get("PEER_VENV", "/tmp/kvstrata-peer"))
TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def test_bench_radix_relative_trace_matches_peer_hit_rates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no SGLang peer venv at {PEER_VENV}: run shared/bench/peer/setup.sh first")
    monkeypatch.chdir(TRACE.parent)
    threads = torch.get_num_threads()
    try:
        code = radix.main(
            [
                "--trace", TRACE.name,
                "--limit", "30",
                "--capacity-blocks", "300",
                "--repeats", "1",
                "--peer-python", str(python),
            ]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # the benchmark pins its own thread count
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["requests"] == 30
    assert 0 < report["hit_rate"] < 1
    for peer in ("peer_classic", "peer_unified"):
        assert report[peer]["hit_rate"] == pytest.approx(report["hit_rate"], abs=1e-12)
    assert report["ratio_vs_classic"] > 0 and report["ratio_vs_unified"] > 0
