"""`kvstrata bench l2` runs end to end and prints one JSON line per figure with its baseline
(a smoke run: tiny sizes, one repeat; the figures themselves are not asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.bench import l2


def test_bench_l2_prints_figures_with_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = l2.main(
            [
                "--device",
                "cpu",
                "--mib",
                "1",
                "--repeats",
                "1",
                "--page-sizes",
                "16",
                "--layers",
                "2",
            ]
        )
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread for its own timing
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    header, figures = lines[0], lines[1:]
    assert header["device"] == "cpu" and "CPU memory" in header["note"]
    assert len(figures) == 3 * 2 * 2  # layouts x patterns x (backup, load_layers)
    for fig in figures:
        assert fig["device"] == "cpu"
        assert fig["op"] in ("backup", "load_layers")
        assert fig["gbps"] > 0 and fig["baseline_gbps"] > 0 and fig["ratio"] > 0
        assert fig["page_bytes"] >= 64 << 10
    assert {f["layout"] for f in figures} == {"layer_first", "page_first", "page_first_direct"}
    assert all(f.get("target_ratio") == 0.7 for f in figures if f["layout"] == "page_first")
