"""`kvstrata bench alloc --quick` runs end to end and prints the peer script's keys.

A smoke test of the benchmark's plumbing (workload generation, setup/teardown bookkeeping,
JSON lines); it asserts no time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstrata.bench import alloc as bench


def test_quick_run_prints_one_line_per_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--no-peer", "--no-page-io", "--rounds", "3", "--page-sizes", "1,16"]
    assert bench.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["workload"], r["page_size"]) for r in lines] == [
        ("extend", 1),
        ("extend", 16),
        ("decode", 1),
        ("decode", 16),
    ]
    for record in lines:
        assert {"workload", "page_size", "tokens_per_s", "calls_per_s", "ratio"} <= set(record)
        assert record["tokens_per_s"] > 0 and record["peer_tokens_per_s"] is None
        assert set(record["variants"]) == {"numpy", "numpy-unchecked", "torch"}
        assert "check_cost" in record


def test_workloads_match_the_peer_definition() -> None:
    # First draws of default_rng(0), as alloc_bench.py makes them.
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 2048, size=64, endpoint=True)
    ext = rng.integers(1, 512, size=64, endpoint=True)
    first = bench.extend_rounds(0, 2)[0]
    assert first.prefix_lens.tolist() == prefix.tolist()
    assert first.extend_lens.tolist() == ext.tolist()
    decode = bench.decode_rounds(0, 1)[0]
    assert (
        decode.tolist() == np.random.default_rng(0).integers(1, 4096, 256, endpoint=True).tolist()
    )


def test_rejects_unknown_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--no-peer", "--variants", "nope"]) == 2
    assert "unknown variant" in capsys.readouterr().err
