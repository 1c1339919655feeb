"""`kvstrata bench radix` (kvstrata.bench.radix) end to end on a small trace, without the peer:
one JSON line with the peer script's keys and the hit rate of the workload definition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench import radix


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
