"""`kvstrata bench overlap` runs end to end and reports its figures beside their baseline (a
smoke test on a tiny configuration; it asserts no time)."""

from __future__ import annotations

import json

import pytest

from kvstrata.bench import load


@pytest.mark.parametrize("compute", ["native", "python"])
def test_overlap_bench_prints_one_record_per_configuration(
    compute: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = load("overlap")
    argv = ["--layers", "3", "--pages", "2", "--kv-heads", "2", "--head-dim", "8"]
    argv += ["--compute-ms", "0.1", "0.2", "--compute", compute, "--repeats", "1"]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["compute_ms_per_layer"] for r in records] == [0.1, 0.2]
    for r in records:
        assert r["bench"] == "overlap" and r["compute"] == compute
        assert r["baseline_s"] == max(r["compute_s"], r["transfer_s"])
        assert r["ratio"] == pytest.approx(r["overlap_s"] / r["baseline_s"], rel=1e-2)
        # The transfer and overlap runs load once each, in the warm-up and in the one round.
        assert r["loads_done"] == 4
