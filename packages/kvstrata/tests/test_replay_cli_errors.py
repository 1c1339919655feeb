"""`kvstrata replay` error reports: bad traces exit 2 with the file, line and reason, and an
error is one line on stderr whatever its length (issue 17, items 7 and 8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstrata.cli.errors import one_line
from kvstrata.cli.main import main
from kvstrata.replay import EmptyTrace, TraceFormatError, read_trace


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # rich wraps at the terminal width it detects; 80 columns is the case the issue reports.
    monkeypatch.setenv("COLUMNS", "80")


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_a_trace_that_is_not_utf8_names_the_file_line_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"hash_ids": [0, 1]}\n{"hash_ids": [2], "note": "caf\xe9"}\n')
    with pytest.raises(TraceFormatError) as caught:
        read_trace(path)
    assert (caught.value.path, caught.value.line_number) == (str(path), 2)
    assert main(["replay", "--no-progress", "--trace", str(path)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert f"{path}:2: not UTF-8 (byte 0xe9 at column 31)" in lines[0]


@pytest.mark.parametrize("content", [b"", b"\n\n   \n"], ids=["empty", "blank-lines"])
def test_a_trace_without_requests_exits_2(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(EmptyTrace):
        read_trace(path)
    assert read_trace(path, limit=0) == []  # asking for none is not an error
    assert main(["replay", "--no-progress", "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert _error_lines(captured.err) == [f"error: no requests in {path}"]
    assert captured.out == ""  # no table of zeros


def test_a_long_error_is_one_line_at_80_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / "[red]not-markup"
    deep.mkdir(parents=True)
    path = deep / "trace.jsonl"
    path.write_text('{"hash_ids": [0, "one"]}\n', encoding="utf-8")
    assert main(["replay", "--no-progress", "--trace", str(path)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and len(lines[0]) > 80
    assert lines[0] == f"error: {path}:1: 'hash_ids'[1] must be a non-negative integer, got 'one'"


def test_a_message_with_line_breaks_is_folded_into_one_line() -> None:
    assert one_line("first\n  second\r\nthird\n") == "first second third"
    assert one_line("single") == "single"
