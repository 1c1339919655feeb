"""Mooncake trace reading: block ids become token runs; malformed lines name their line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstrata.replay import ReplayOptionError, TraceFormatError, read_trace
from kvstrata.replay.trace import parse_trace_line
from kvstrata.testkit import WORKSPACE_ROOT

SHARED_TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_blocks_become_token_runs(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '{"timestamp": 5, "input_length": 7, "output_length": 3, "hash_ids": [0, 2]}',
        "",
        '{"hash_ids": [0, 1, 7]}',
    )
    first, second = read_trace(path, tokens_per_block=4)
    assert first.token_ids.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert (first.timestamp_ms, first.output_length) == (5, 3)
    assert second.token_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 28, 29, 30, 31]
    assert (second.timestamp_ms, second.output_length) == (None, 0)
    # Equal block prefixes give equal token prefixes, and nothing beyond them.
    assert np.array_equal(first.token_ids[:4], second.token_ids[:4])
    assert first.token_ids[4] != second.token_ids[4]


def test_limit_counts_requests_not_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "", '{"hash_ids": [1]}', "", '{"hash_ids": [2]}', '{"hash_ids": [3]}')
    assert [r.token_ids[0] for r in read_trace(path, tokens_per_block=1, limit=2)] == [1, 2]
    assert read_trace(path, tokens_per_block=1, limit=0) == []


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got a list"),
        ('{"input_length": 3}', "missing key 'hash_ids'"),
        ('{"hash_ids": []}', "'hash_ids' must be a non-empty list"),
        ('{"hash_ids": "0,1"}', "'hash_ids' must be a non-empty list, got a string"),
        ('{"hash_ids": [0, -1]}', "'hash_ids'[1] must be a non-negative integer"),
        ('{"hash_ids": [0, 1.5]}', "'hash_ids'[1] must be a non-negative integer"),
        ('{"hash_ids": [true]}', "'hash_ids'[0] must be a non-negative integer"),
        ('{"hash_ids": [0], "output_length": "x"}', "'output_length' must be a non-negative"),
        ('{"hash_ids": [0], "timestamp": -4}', "'timestamp' must be a non-negative integer"),
        ('{"hash_ids": [9223372036854775807]}', "too large for int64"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = _write(tmp_path, '{"hash_ids": [0]}', "", line, '{"hash_ids": [1]}')
    with pytest.raises(TraceFormatError) as caught:
        read_trace(path, tokens_per_block=16)
    assert caught.value.line_number == 3
    assert str(caught.value).startswith(f"{path}:3: ")
    assert reason in caught.value.reason


def test_bad_options_are_refused_before_reading(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(ReplayOptionError):
        read_trace(missing, tokens_per_block=0)
    with pytest.raises(ReplayOptionError):
        read_trace(missing, limit=-1)


def test_blank_line_is_no_request() -> None:
    assert parse_trace_line("   \n", tokens_per_block=16) is None


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"no shared trace at {SHARED_TRACE}")
def test_shared_trace_parses_with_its_documented_totals() -> None:
    # shared/traces/README.md: 12,031 requests and 288,500 block references.
    requests = read_trace(SHARED_TRACE, tokens_per_block=16)
    assert len(requests) == 12_031
    assert sum(r.num_tokens for r in requests) == 288_500 * 16
    assert all(r.token_ids[0] == 0 for r in requests[:100])  # block 0 opens every request
