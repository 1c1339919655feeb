"""`kvstrata bench l3` runs end to end and prints one JSON line per figure with its baseline
(a smoke run: tiny sizes, one repeat; the figures themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.bench import l3


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    threads = torch.get_num_threads()
    try:
        assert l3.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark pins one thread for its own timing
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_bench_l3_file_figures_per_store_and_thread_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = run(
        [
            "--skip", "memory", "keyer",
            "--page-bytes", "4096",
            "--total-mib", "1",
            "--batch", "16",
            "--repeats", "1",
            "--io-threads", "1,3",
            "--dir", str(tmp_path),
        ],
        capsys,
    )  # fmt: skip
    env = lines[0]["environment"]
    assert isinstance(env, dict)
    assert str(env["bench_dir"]).startswith(str(tmp_path)) and env["bench_fs"] != ""
    figures = lines[1:]
    assert [(f["op"], f.get("store"), f["io_threads"]) for f in figures] == [
        (op, store, threads)
        for threads in (1, 3)
        for op, store in (("set", "new"), ("set", "cleared"), ("set", "full"), ("get", None))
    ]
    for fig in figures:
        assert fig["backend"] == "file" and fig["page_bytes"] == 4096
        assert fig["bytes"] == 1 << 20 and fig["target_ratio"] == 0.8
        for field in ("gb_per_s", "baseline_gb_per_s", "per_file_baseline_gb_per_s", "ratio"):
            value = fig[field]
            assert isinstance(value, float) and value > 0, field
    assert list(tmp_path.iterdir()) == []  # the bench removes its files


def test_bench_l3_refuses_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--io-threads", "0"], ["--dir", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit):
            l3.main(argv)
    assert "error" in capsys.readouterr().err
