"""`kvstrata replay`: options, the summary table, the JSON record and error exits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstrata.build import FAMILIES, POLICIES
from kvstrata.cli.main import main
from kvstrata.cli.replay_command import FAMILY_CHOICES, JSON_KEYS, POLICY_CHOICES


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    # The command sets torch's thread count (--threads, default 1); give the next test its own.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 60, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4]},
        {"timestamp": 2, "input_length": 30, "output_length": 4, "hash_ids": [0, 5]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_choices_match_the_build_layer() -> None:
    assert FAMILY_CHOICES == FAMILIES
    assert POLICY_CHOICES == POLICIES


def test_embedded_workload_summary_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "summary.json"
    argv = ["replay", "--unbounded", "--limit", "40", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert tuple(record) == JSON_KEYS
    assert record["source"] == "embedded workload (seed 0)"
    assert record["requests"] == 40
    assert record["unbounded"] is True and record["evicted_tokens"] == 0
    assert record["tokens_per_block"] is None
    assert 0 < record["hit_tokens"] <= record["prompt_tokens"]
    assert record["hit_rate"] == round(record["hit_tokens"] / record["prompt_tokens"], 6)
    assert record["requests_per_s"] > 0 and record["tokens_per_s"] > 0
    captured = capsys.readouterr()
    for row in ("requests", "prompt tokens", "hit tokens", "hit rate", "evicted tokens"):
        assert row in captured.out
    assert "requests/s" in captured.out and "tokens/s" in captured.out
    assert captured.err == ""  # no progress bar when stderr is not a terminal


def test_trace_with_family_capacity_and_verify(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    argv = [
        "replay",
        "--trace",
        str(_trace(tmp_path)),
        "--tokens-per-block",
        "8",
        "--page-size",
        "8",
        "--capacity-tokens",
        "64",
        "--family",
        "swa",
        "--policy",
        "lfu",
        "--verify",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert (record["family"], record["policy"], record["page_size"]) == ("swa", "lfu", 8)
    assert record["capacity_tokens"] == 64 and record["unbounded"] is False
    assert record["tokens_per_block"] == 8
    assert record["requests"] == 3
    assert record["prompt_tokens"] == (3 + 5 + 2) * 8
    # [0,1,2] then [0,1,2,3,4] reuses 3 blocks, then [0,5] reuses block 0 if it survived.
    assert 24 <= record["hit_tokens"] <= 32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity-tokens", "16"], "cannot hold request 0"),
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["--limit", "-1"], "--limit must be >= 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--page-size", "0"], "page_size must be >= 1"),
        (["--page-size", "0", "--unbounded"], "page_size must be >= 1"),
        (["--plot", "figure.jpg"], "must end in .png"),
        (["--metrics-hold", "-1", "--metrics-port", "0"], "--metrics-hold must be >= 0"),
        (["--metrics-hold", "5"], "--metrics-hold needs --metrics-port"),
        (["--metrics-port", "70000"], "--metrics-port must be in 0..65535"),
        (["--metrics-port", "0", "--metrics-addr", "localhost"], "must be an IP address"),
        (["--unbounded", "--capacity-tokens", "64"], "--unbounded takes no"),
        (["--unbounded", "--host-ratio", "2"], "--unbounded takes no"),
    ],
)
def test_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_malformed_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [0]}\n{"hash_ids": []}\n', encoding="utf-8")
    assert main(["replay", "--trace", str(path)]) == 2
    assert f"{path}:2:" in capsys.readouterr().err.replace("\n", "")


def test_unknown_family_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["replay", "--family", "mla"])
    assert caught.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
