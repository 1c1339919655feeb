"""The options every trace-replay benchmark shares (kvstrata.bench.trace_input): declared once,
with the same defaults, and refused (exit 2, the flag named) before anything is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.trace_input import check_trace_options, read_keys, trace_replay_parser


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in ([3, 1], [], [2])))
    return path


def test_parser_declares_the_shared_options_with_their_defaults(trace: Path) -> None:
    parser = trace_replay_parser("radix", "d", limit=3000)
    assert parser.prog == "kvstrata bench radix"
    args = parser.parse_args(["--trace", str(trace)])
    assert (args.trace, args.tokens_per_block, args.page_size, args.limit) == (trace, 16, 16, 3000)
    check_trace_options(parser, args)
    no_page = trace_replay_parser("plan", "d", page_size=False).parse_args(["--trace", str(trace)])
    assert not hasattr(no_page, "page_size") and no_page.limit == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens-per-block", "0"], "--tokens-per-block must be >= 1, got 0"),
        (["--page-size", "0"], "--page-size must be >= 1, got 0"),
        (["--limit", "-1"], "--limit must be >= 0, got -1"),
    ],
)
def test_check_refuses_bad_sizes(
    trace: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = trace_replay_parser("radix", "d")
    args = parser.parse_args(["--trace", str(trace), *argv])
    with pytest.raises(SystemExit) as exit_info:
        check_trace_options(parser, args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_check_refuses_a_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = trace_replay_parser("plan", "d", page_size=False)
    args = parser.parse_args(["--trace", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit):
        check_trace_options(parser, args)
    assert "no trace at" in capsys.readouterr().err


def test_read_keys_spreads_each_block_over_its_tokens(trace: Path) -> None:
    keys = read_keys(trace, 2, 0)
    assert [list(k) for k in keys] == [[6, 7, 2, 3], [], [4, 5]]
    assert len(read_keys(trace, 2, 2)) == 2
