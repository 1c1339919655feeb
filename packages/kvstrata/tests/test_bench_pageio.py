"""`kvstrata bench pageio` runs end to end: one record per (operation, page size), each figure
beside its baseline (a smoke run: tiny sizes, one repeat; the figures are not asserted)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvstrata.bench import pageio
from kvstrata.bench.gather_ref import reference_ops
from kvstrata.pool.native import native_copies


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


def test_each_line_sets_the_numpy_reference_beside_ours() -> None:
    # The reference reads exactly what read_pages reads (the benchmark checks and raises
    # otherwise); `path` names the pools' copy path.
    records = pageio.run_page_io(page_sizes=[1, 2], num_pages=3, num_layers=2, repeats=1)
    want = "native" if native_copies() is not None else "numpy"
    for r in records:
        ref = pageio.REFERENCES[r["op"]]
        assert ref == ("numpy_take" if r["op"] == "read_pages" else "numpy_put")
        assert r["reference_ratios"][ref] > 0
        assert r["path"] == want


def test_reference_ops_move_the_numbered_pieces() -> None:
    pool_bytes = np.zeros(6 * 8, dtype=np.uint8)
    flat = np.arange(3 * 8, dtype=np.uint8)
    pieces = np.array([4, 0, 2], dtype=np.int64)
    ops = reference_ops(pool_bytes, flat, pieces, 8)
    ops["numpy_put"]()
    items = pool_bytes.reshape(6, 8)
    assert items[4].tolist() == list(range(8)) and items[0].tolist() == list(range(8, 16))
    assert items[2].tolist() == list(range(16, 24)) and not items[[1, 3, 5]].any()
    flat[:] = 0
    ops["numpy_take"]()
    assert flat.tolist() == list(range(24))
