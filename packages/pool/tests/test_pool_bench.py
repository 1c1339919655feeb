"""`kvstrata bench pageio` runs end to end: one record per (operation, page size), each figure
beside its baseline (a smoke run: tiny sizes, one repeat; the figures are not asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.bench import pageio


def test_run_page_io_gives_a_figure_and_a_baseline_per_op_and_page_size() -> None:
    records = pageio.run_page_io(page_sizes=[1, 4], num_pages=4, num_layers=2, repeats=1)
    assert [(r["op"], r["page_size"]) for r in records] == [
        ("read_pages", 1),
        ("write_pages", 1),
        ("read_pages", 4),
        ("write_pages", 4),
    ]
    for r in records:
        # 2 layers x (K + V) x 2 heads x 128 dims x 2 bytes per token, 4 pages per call
        assert r["bytes"] == 4 * r["page_size"] * 2 * 2 * 2 * 128 * 2
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=0.01)
        assert r["device"] == "cpu" and r["family"] == "mha" and r["dtype"] == "bfloat16"


def test_main_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = pageio.main(["--page-sizes", "2", "--num-pages", "2", "--layers", "1"])
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread for its own timing
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "environment" in lines[0]
    assert [line["op"] for line in lines[1:]] == ["read_pages", "write_pages"]
