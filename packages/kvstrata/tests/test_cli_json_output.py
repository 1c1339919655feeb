"""`kvstrata.cli.json_output.write_json`: the `--json` writer every replay command shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.json_output import write_json


def test_writes_indented_json_with_a_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    assert write_json(path, {"hit_rate": 0.5, "runs": [1, 2]})
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert text == json.dumps({"hit_rate": 0.5, "runs": [1, 2]}, indent=2) + "\n"


def test_no_path_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert write_json(None, {"a": 1})
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == ""


def test_unwritable_path_prints_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "missing-dir" / "out.json"
    assert not write_json(path, {"a": 1})
    assert not path.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write ")
    assert "out.json" in err and err.count("\n") == 1
