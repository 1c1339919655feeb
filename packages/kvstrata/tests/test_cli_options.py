"""`kvstrata.cli.options`: the options several commands share (`--trace`, `--json`, `--plot`)
and the requests a replay runs, declared and checked in one place."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstrata.cli.main import COMMANDS, build_parser
from kvstrata.cli.options import (
    add_output_options,
    add_trace_option,
    check_plot_path,
    load_requests,
)
from kvstrata.plan import PlanOptionError
from kvstrata.replay import ReplayError


def test_trace_is_required_unless_the_command_has_a_fallback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    required = argparse.ArgumentParser()
    add_trace_option(required)
    with pytest.raises(SystemExit):
        required.parse_args([])
    assert "--trace" in capsys.readouterr().err
    optional = argparse.ArgumentParser()
    add_trace_option(optional, absent="the embedded workload")
    assert optional.parse_args([]).trace is None
    assert optional.parse_args(["--trace", "t.jsonl"]).trace == Path("t.jsonl")
    assert "without it, the embedded workload" in " ".join(optional.format_help().split())


def test_the_shared_flags_read_the_same_in_every_command() -> None:
    parser = build_parser()
    plan = parser.parse_args(["plan", "--trace", "t", "--target", "0.5", "--json", "o.json"])
    replay = parser.parse_args(["replay", "--trace", "t", "--json", "o.json", "--plot", "p.png"])
    assert plan.trace == replay.trace == Path("t")
    assert plan.json == replay.json == Path("o.json")
    assert (plan.plot, replay.plot) == (None, Path("p.png"))


@pytest.mark.parametrize("error", [PlanOptionError, ReplayError])
def test_plot_must_name_a_png(error: type[Exception]) -> None:
    check_plot_path(None, error)
    check_plot_path(Path("figure.PNG"), error)
    with pytest.raises(error, match=r"--plot writes a PNG: .* got figure\.jpg"):
        check_plot_path(Path("figure.jpg"), error)


def test_output_options_take_file_paths() -> None:
    parser = argparse.ArgumentParser()
    add_output_options(parser, json_help="j", plot_help="p")
    args = parser.parse_args(["--json", "a.json", "--plot", "b.png"])
    assert (args.json, args.plot) == (Path("a.json"), Path("b.png"))


def test_load_requests_reads_the_trace_or_the_embedded_workload(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in ([1, 2], [1], [3])))
    given = argparse.Namespace(trace=trace, tokens_per_block=4, limit=2, seed=0)
    requests, source = load_requests(given)
    assert source == str(trace)
    assert [r.num_tokens for r in requests] == [8, 4]
    embedded = argparse.Namespace(trace=None, tokens_per_block=4, limit=3, seed=5)
    requests, source = load_requests(embedded)
    assert source == "embedded workload (seed 5)"
    assert len(requests) == 3


def test_every_command_is_registered_with_its_name_help_and_docstring() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in COMMANDS:
        assert command.__doc__ is not None
        assert command.__doc__.startswith(f"`kvstrata {command.NAME}")
        parser = sub.choices[command.NAME]
        assert parser.description == command.__doc__
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert all(helps[command.NAME] == command.HELP for command in COMMANDS)
