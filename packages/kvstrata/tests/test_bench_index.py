"""`kvstrata bench index` (kvstrata.bench.index) end to end on a small trace, in process: it says
which index core ran, and with the compiled core it measures the Python core beside it in the
same run; with the compiled core off (`kvstrata.pool.native.disabled()`) only the Python core
runs and says so. Figures are printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench import index as bench_index
from kvstrata.pool.native import disabled
from kvstrata.prefix_index.native import native_core


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    lines = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [5], [0, 6], [0, 1, 3, 7, 8]] * 4
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in lines))
    return path


def _records(capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    return {r["bench"]: r for r in lines}


def _run(trace: Path) -> int:
    argv = ["--trace", str(trace), "--capacity-pages", "6", "--repeats", "1", "--no-routing"]
    return bench_index.main(argv)


def test_bench_names_the_core_and_compares_with_python(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(trace) == 0
    records = _records(capsys)
    ops, memory = records["index_ops"], records["index_memory"]
    native = native_core(32, {"device": 1}, None) is not None
    assert ops["core"] == memory["core"] == ("native" if native else "python")
    assert str(ops["native_status"]).startswith("native: " if native else "python: ")
    assert ("python_core" in ops) == native
    assert ("native_floor_ops_per_cpu_s" in ops) == native
    assert ops["unbounded"]["ops"] == ops["requests"] + ops["events"]  # type: ignore[index]
    assert int(ops["harness_ns_per_op"]) > 0  # pyright: ignore[reportArgumentType]
    assert memory["entries"] == 9


def test_bench_without_the_compiled_core_runs_python_only(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with disabled():
        assert _run(trace) == 0
    ops = _records(capsys)["index_ops"]
    assert ops["core"] == "python" and str(ops["native_status"]).startswith("python: ")
    assert "python_core" not in ops and "native_floor_ops_per_cpu_s" not in ops
