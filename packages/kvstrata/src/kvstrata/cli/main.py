"""Entry point of the `kvstrata` command.

Each subcommand lives in its own module and registers itself through `add_parser`; this module
only assembles the parser and dispatches, so adding a command never touches the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from kvstrata.cli import plan_command, replay_command, size_command

#: Distributions of the workspace, in layer order (bottom first), as `kvstrata version` lists them.
DISTRIBUTIONS: tuple[str, ...] = (
    "kvstrata-core",
    "kvstrata-pool",
    "kvstrata-storage",
    "kvstrata-allocator",
    "kvstrata-pool-host",
    "kvstrata-hybrid-cache",
    "kvstrata-unified-radix-cache",
    "kvstrata",
)

Handler = Callable[[argparse.Namespace], int]


def _version(_args: argparse.Namespace) -> int:
    for dist in DISTRIBUTIONS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{dist} {version}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvstrata import bench

    try:
        run = bench.load(args.name)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    return run(list(args.options))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="KV-cache memory system: replay request traces and run benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    version = sub.add_parser("version", help="print the version of every kvstrata distribution")
    version.set_defaults(handler=_version)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark; prints JSON lines with ratios against a same-run baseline",
        description="Run `kvstrata bench NAME --help` for the options of one benchmark.",
    )
    bench.add_argument("name", help="benchmark name (alloc, radix, l2, l3, ...)")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")
    bench.set_defaults(handler=_bench)
    replay_command.add_parser(sub)
    plan_command.add_parser(sub)
    size_command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
