"""`kvstrata bench evict_undo` (kvstrata.bench.evict_undo) on a small trace: one JSON line with
both variants, which evict the same tokens and hit the same prefixes; the journal-free variant
is only swapped in for its own passes. Figures are printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench import evict_undo
from kvstrata.unified_radix_cache import evict_undo as undo_module


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    lines = [[0, 1, 2], [0, 1, 3], [4, 5, 6], [0, 1, 2, 7], [8, 9], [0, 6]]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in lines))
    return path


def test_bench_prints_both_variants(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = undo_module.evict_components
    argv = ["--trace", str(trace), "--tokens-per-block", "4", "--page-size", "2"]
    argv += ["--capacity-blocks", "5", "--window", "4", "--repeats", "2", "--limit", "0"]
    assert evict_undo.main(argv) == 0
    assert undo_module.evict_components is built
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["requests"] == 6
    journal, plain = record["journal"], record["plain"]
    assert journal["evict_calls"] == plain["evict_calls"] > 0
    assert journal["evicted"] == plain["evicted"] and journal["evicted"]["full"] > 0
    assert journal["hit_rate"] == plain["hit_rate"] > 0
    assert len(journal["seconds_all"]) == 2
    assert record["evict_cost"] is not None


def test_bench_refuses_bad_options(trace: Path) -> None:
    with pytest.raises(SystemExit):
        evict_undo.main(["--trace", str(trace), "--capacity-blocks", "0"])
    with pytest.raises(SystemExit):
        evict_undo.main(["--trace", str(trace.parent / "missing.jsonl")])
