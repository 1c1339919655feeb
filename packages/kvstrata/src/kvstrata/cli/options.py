"""The options and inputs several commands share, declared once so that a flag has the same
name, meaning and help wherever it appears: the trace (`--trace`), the output files (`--json`,
`--plot`), the requests a replay runs (`replay`, and its cluster form) and the tiers its flags
ask for."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.replay import ReplayRequest
    from kvstrata.replay.compare import TierConfig


def add_trace_option(parser: argparse.ArgumentParser, *, absent: str | None = None) -> None:
    """`--trace FILE`: the Mooncake-format trace the command reads; required unless `absent`
    says what the command reads without one."""
    help_text = "Mooncake-format trace (JSON lines with hash_ids)"
    if absent is not None:
        help_text += f"; without it, {absent}"
    parser.add_argument("--trace", type=Path, required=absent is None, help=help_text)


def add_output_options(parser: argparse.ArgumentParser, *, json_help: str, plot_help: str) -> None:
    """`--json FILE` (written by `json_output.write_json`) and `--plot FILE.png` (checked by
    `check_plot_path`)."""
    parser.add_argument("--json", type=Path, metavar="FILE", help=json_help)
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help=plot_help)


def check_plot_path(plot: Path | None, error: type[Exception]) -> None:
    """Raise `error` (the command's option error) unless `--plot` is absent or names a PNG."""
    if plot is not None and plot.suffix.lower() != ".png":
        raise error(f"--plot writes a PNG: the file name must end in .png, got {plot}")


def load_requests(args: argparse.Namespace) -> tuple[list[ReplayRequest], str]:
    """The requests of a replay and where they come from: `--trace` (blocks of
    `--tokens-per-block` tokens), else the embedded workload of `--seed`; the first `--limit`."""
    from kvstrata.replay import WorkloadSpec, generate_workload, read_trace

    if args.trace is not None:
        requests = read_trace(args.trace, tokens_per_block=args.tokens_per_block, limit=args.limit)
        return requests, str(args.trace)
    requests = generate_workload(WorkloadSpec(seed=args.seed))[: args.limit]
    return requests, f"embedded workload (seed {args.seed})"


def tier_config(args: argparse.Namespace, *, name: str, capacity_tokens: int | None) -> TierConfig:
    """The memory system `replay`'s tier flags ask for (`--host-ratio` / `--host-bytes`,
    `--storage`, `--write-policy`, `--prefetch-policy`, `--prefetch-threshold`), for the
    stand-in and the reference engine alike."""
    from kvstrata.replay.compare import TierConfig

    return TierConfig(
        name=name,
        capacity_tokens=capacity_tokens,
        host_ratio=args.host_ratio,
        host_bytes=args.host_bytes,
        storage_url=args.storage,
        write_policy=args.write_policy,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold=args.prefetch_threshold,
    )
