"""`kvstrata bench radix` (kvstrata.bench.radix) end to end: on a small trace without the peer (one
JSON line with the peer script's keys and the hit rate of the workload definition), and beside the
SGLang peer as a user runs it, with a trace path relative to the working directory (the peer script
runs from its own folder, so the path must be resolved before it is handed over). The peer venv is
a CI prerequisite (`.ci/run` runs setup.sh): without it that test fails, it does not skip.
Figures are printed, never asserted; hit rates are (both trees run LRU over the same blocks)."""

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


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    lines = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [5], [0, 6]]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in lines))
    return path


# Hits per request, in blocks. Unbounded: 0, 2, 3, 0, 1. At 3 blocks (12 tokens): request 3
# finds block 2 evicted for request 2, and only the locked [0, 1] is left to evict, so it
# overshoots once; request 5 still finds block 0.
@pytest.mark.parametrize(("capacity", "hit_blocks", "over"), [(0, 6, None), (3, 5, 1)])
def test_bench_prints_one_json_line(
    trace: Path,
    capacity: int,
    hit_blocks: int,
    over: int | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--trace", str(trace), "--tokens-per-block", "4", "--page-size", "2", "--no-peer"]
    argv += ["--repeats", "1", "--capacity-blocks", str(capacity), "--values", "numpy"]
    assert radix.main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    for key in (
        "requests",
        "tokens",
        "hit_tokens",
        "hit_rate",
        "seconds",
        "requests_per_s",
        "tokens_per_s",
        "evicted_tokens",
    ):
        assert key in record
    assert record["requests"] == 5 and record["tokens"] == 13 * 4
    assert record["hit_tokens"] == hit_blocks * 4
    assert record.get("over_capacity_inserts") == over
    assert "peer_classic" not in record


def test_bench_refuses_a_missing_peer(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trace", str(trace), "--peer-python", "/nonexistent/python", "--repeats", "1"]
    assert radix.main(argv) != 0


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
