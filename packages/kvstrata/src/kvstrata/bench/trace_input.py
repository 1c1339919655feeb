"""The Mooncake trace input of the benchmarks that replay one (radix, evict_undo, plan): their
common options, declared once so that a flag has the same name, default and help in every
benchmark, their checks, and the token keys of the requests."""

from __future__ import annotations

import argparse
import json
from array import array
from pathlib import Path


def read_keys(path: Path, tokens_per_block: int, limit: int) -> list[array]:
    """One int64 token array per request (block h -> h*T .. h*T+T-1), as the peer builds them."""
    t = tokens_per_block
    keys: list[array] = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            ids = json.loads(line)["hash_ids"]
            keys.append(array("q", [h * t + j for h in ids for j in range(t)]))
            if limit and len(keys) >= limit:
                break
    return keys


def trace_replay_parser(
    name: str, description: str, *, limit: int = 0, page_size: bool = True
) -> argparse.ArgumentParser:
    """The parser of `kvstrata bench NAME` for a benchmark that replays a Mooncake trace, with
    the options every such benchmark takes declared once (same names, defaults and help):
    `--trace` (required), `--tokens-per-block`, `--page-size` (unless `page_size` is False) and
    `--limit` (default `limit`; 0 = the whole trace). Check them with `check_trace_options`."""
    parser = argparse.ArgumentParser(prog=f"kvstrata bench {name}", description=description)
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=16,
        help="tokens per trace block: block h is tokens h*T .. h*T+T-1 (default 16)",
    )
    if page_size:
        parser.add_argument(
            "--page-size", type=int, default=16, help="tokens per page (default 16)"
        )
    parser.add_argument(
        "--limit", type=int, default=limit, help=f"first N requests only (0 = all; default {limit})"
    )
    return parser


def check_trace_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through `parser.error` (status 2) unless the options of `trace_replay_parser` are
    usable: block and page sizes >= 1, `--limit` >= 0, and a trace file that exists."""
    sizes = {
        "--tokens-per-block": args.tokens_per_block,
        "--page-size": getattr(args, "page_size", None),
    }
    for flag, value in sizes.items():
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.limit < 0:
        parser.error(f"--limit must be >= 0, got {args.limit}")
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
