"""`kvstrata plan` and `kvstrata bench plan`: tables, JSON, the plot and error exits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata import bench
from kvstrata.cli.main import main
from kvstrata.cli.plan_command import JSON_KEYS, default_capacities
from kvstrata.plan import BlockTrace, lru_curve


def _chains() -> list[list[int]]:
    return [
        [0, 100 + conversation, *(1000 + 10 * conversation + i for i in range(turn + 1))]
        for conversation in range(6)
        for turn in range(5)
    ]


def _trace(tmp_path: Path, chains: list[list[int]] | None = None) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": i, "input_length": 8 * len(c), "output_length": 2, "hash_ids": c}
        for i, c in enumerate(chains if chains is not None else _chains())
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path)
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "--trace", str(trace), "--target", "0.5", "--device-target", "0.3"]
    argv += ["--bytes-per-token", "1000", "--tokens-per-block", "16"]
    argv += ["--price-device", "10", "--price-host", "2", "--price-storage", "0.5"]
    argv += ["--capacities", "1,8,20", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert tuple(record) == JSON_KEYS
    curve = lru_curve(BlockTrace.from_chains(_chains()))
    assert record["requests"] == 30 and record["distinct_blocks"] == curve.num_distinct
    assert record["ideal_hit_rate"] == round(curve.ideal_hit_rate, 6)
    assert [row["capacity_blocks"] for row in record["curve"]] == [1, 8, 20]
    assert curve.max_request_blocks == 7
    assert [row["page_lru_only"] for row in record["curve"]] == [True, False, False]
    assert [row["hit_blocks"] for row in record["curve"]] == [
        curve.hit_blocks(c) for c in (1, 8, 20)
    ]
    plan = record["plan"]
    assert plan["target"] == 0.5 and plan["bytes_per_token"] == 1000
    costs = {c["combination"]: c["cost"] for c in plan["combinations"]}
    assert costs[plan["recommended"]] == min(costs.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "(recommended)" in captured.out and "unbounded" in captured.out
    assert "below the longest request" in captured.out.replace("\n", " ")
    assert "device+host+storage" in captured.out


def test_defaults_without_prices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--trace", str(_trace(tmp_path)), "--target", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "512 tok" in out  # one block is 512 tokens by default
    assert "device+host+sto" in out


def test_default_capacities() -> None:
    assert default_capacities(7) == [1, 2, 5, 7]
    assert default_capacities(100) == [1, 2, 5, 10, 20, 50, 100]
    assert default_capacities(1) == [1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "0.99"], "unbounded cache hits"),
        (["--target", "0"], "target hit rate"),
        (["--target", "0.3", "--price-device", "1"], "--price-host"),
        (
            ["--target", "0.3", "--price-device", "1", "--price-host", "1", "--price-storage", "1"],
            "bytes_per_token",
        ),
        (["--target", "0.3", "--plot", "x.jpg"], "PNG"),
        (["--target", "0.3", "--capacities", "1,x"], "integers"),
        (["--target", "0.3", "--capacities", "-1"], ">= 0"),
        (["--target", "0.3", "--limit", "0"], "--limit"),
        (["--target", "0.3", "--bytes-per-token", "0"], "bytes_per_token"),
    ],
)
def test_bad_options_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["plan", "--trace", str(_trace(tmp_path)), *extra]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--trace", str(tmp_path / "missing.jsonl"), "--target", "0.3"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    unchained = _trace(tmp_path, [[1, 2], [3, 2]])
    assert main(["plan", "--trace", str(unchained), "--target", "0.3"]) == 2
    assert "chained" in capsys.readouterr().err.replace("\n", " ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\nnot json\n', encoding="utf-8")
    assert main(["plan", "--trace", str(bad), "--target", "0.3"]) == 2
    assert ":2:" in capsys.readouterr().err


def test_nothing_written_on_error(tmp_path: Path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "--trace", str(_trace(tmp_path)), "--target", "0.99"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 2
    assert not out.exists() and not png.exists()


def test_bench_plan_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path)
    run = bench.load("plan")
    assert run(["--trace", str(trace), "--capacities", "7,12", "--repeats", "2"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["bench"] == "plan" and record["replays"] == 2
    assert record["exact"] is True
    curve = lru_curve(BlockTrace.from_chains(_chains()))
    assert [row["curve_hit_tokens"] for row in record["capacities"]] == [
        curve.hit_blocks(c) * 16 for c in (7, 12)
    ]
    # Both medians are rounded to 0.1 ms in the line; the ratio is of the unrounded ones.
    quotient = record["replays_seconds"] / record["curve_seconds"]
    assert record["ratio"] == pytest.approx(quotient, rel=0.1)
    assert len(record["curve_seconds_all"]) == 2
