"""`kvstrata plan`: size the device, host and storage tiers for a target hit rate from a trace.

One pass over the trace gives the leaf-first LRU block hit rate at every capacity (stack
distances, Mattson's algorithm); device <= host <= storage are inclusive LRU levels read off
that curve. Sizes: device = the longest request or what --device-target needs, host = what
--host-target needs, storage = what --target needs; with prices the cheapest combination is
recommended. Prints the curve at a few capacities and the combinations, the recommended one
marked; --json FILE writes the same figures, --plot FILE.png draws them.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from kvstrata.cli.errors import print_error
from kvstrata.cli.json_output import write_json
from kvstrata.cli.options import add_output_options, add_trace_option, check_plot_path

# Only argparse is imported at module level (as for `replay`): the planner imports the trace
# reader of `kvstrata.replay`, which pulls in torch.
if TYPE_CHECKING:
    from rich.table import Table

    from kvstrata.plan import HitCurve, TierPlan, TierPrices

NAME = "plan"
HELP = "size the device, host and storage tiers for a target hit rate from a trace"

#: Keys of the `--json` record, in order.
JSON_KEYS: tuple[str, ...] = (
    "source",
    "requests",
    "block_references",
    "distinct_blocks",
    "max_request_blocks",
    "ideal_hit_rate",
    "curve_seconds",
    "curve",
    "plan",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvstrata plan`."""
    add_trace_option(parser)
    parser.add_argument(
        "--target", type=float, required=True, help="combined block hit rate to reach (0-1)"
    )
    parser.add_argument(
        "--device-target",
        type=float,
        default=0.0,
        help="hit rate the device must serve by itself (default 0)",
    )
    parser.add_argument(
        "--host-target",
        type=float,
        default=0.0,
        help="hit rate device and host must serve together (default 0)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=512,
        help="tokens a trace block stands for (default 512, the Mooncake traces' block)",
    )
    parser.add_argument(
        "--bytes-per-token",
        type=int,
        help="the model's KV bytes per token, all layers (gives sizes in bytes and costs)",
    )
    parser.add_argument("--price-device", type=float, help="price per GB of device memory")
    parser.add_argument("--price-host", type=float, help="price per GB of host memory")
    parser.add_argument("--price-storage", type=float, help="price per GB of storage")
    parser.add_argument(
        "--capacities",
        help="comma-separated capacities (blocks) of the curve table (default 1-2-5 steps)",
    )
    parser.add_argument("--limit", type=int, help="plan from the first N requests only")
    add_output_options(
        parser,
        json_help="also write the figures as JSON",
        plot_help="draw the curve and the combinations",
    )
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """Handler of `kvstrata plan`: 0 on success, 2 for bad options or input."""
    from rich.console import Console

    from kvstrata.plan import PlanError, PlanOptionError, PlanSpec, lru_curve, plan_tiers
    from kvstrata.plan import read_block_trace as read
    from kvstrata.replay import ReplayError

    out = stdout if stdout is not None else sys.stdout
    try:
        if args.limit is not None and args.limit < 1:
            raise PlanOptionError(f"--limit must be >= 1, got {args.limit}")
        capacities = _parse_capacities(args.capacities)
        spec = PlanSpec(
            target=args.target,
            device_target=args.device_target,
            host_target=args.host_target,
            tokens_per_block=args.tokens_per_block,
            bytes_per_token=args.bytes_per_token,
            prices=_prices(args),
        )
        check_plot_path(args.plot, PlanOptionError)
        trace = read(args.trace, limit=args.limit)
        started = time.perf_counter()
        curve = lru_curve(trace)
        curve_seconds = time.perf_counter() - started
        plan = plan_tiers(curve, spec)
        if capacities is None:
            capacities = default_capacities(curve.num_distinct)
    except (PlanError, ReplayError, OSError) as exc:
        print_error(str(exc))
        return 2
    record: dict[str, object] = {
        "source": str(args.trace),
        "requests": curve.num_requests,
        "block_references": curve.num_references,
        "distinct_blocks": curve.num_distinct,
        "max_request_blocks": curve.max_request_blocks,
        "ideal_hit_rate": round(curve.ideal_hit_rate, 6),
        "curve_seconds": round(curve_seconds, 4),
        "curve": [
            {
                "capacity_blocks": c,
                "hit_blocks": curve.hit_blocks(c),
                "hit_rate": round(r, 6),
                # Below the longest request a tree cannot run the trace: the page LRU's figure.
                "page_lru_only": c < curve.max_request_blocks,
            }
            for c, r in zip(capacities, curve.hit_rates(capacities).tolist(), strict=True)
        ],
        "plan": plan.to_json(),
    }
    assert tuple(record) == JSON_KEYS, f"JSON_KEYS is stale: {tuple(record)}"
    console = Console(file=out, width=max(120, Console(file=out).width))
    console.print(_curve_table(record, curve, spec.tokens_per_block, spec.bytes_per_block))
    console.print(_plan_table(plan))
    if not write_json(args.json, record):
        return 2
    if args.plot is not None:
        from kvstrata.plan.plot import plot_plan

        try:
            plot_plan(curve, plan, args.plot, title=f"kvstrata plan: {args.trace.name}")
        except OSError as exc:
            print_error(f"cannot write {args.plot}: {exc}")
            return 2
    return 0


def default_capacities(num_distinct: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the distinct blocks, then the distinct blocks."""
    steps: list[int] = []
    scale = 1
    while scale <= num_distinct:
        steps.extend(s * scale for s in (1, 2, 5) if s * scale < num_distinct)
        scale *= 10
    return [*steps, num_distinct]


def _parse_capacities(text: str | None) -> list[int] | None:
    from kvstrata.plan import PlanOptionError

    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise PlanOptionError(f"--capacities takes integers separated by commas: {exc}") from exc
    if not values or min(values) < 0:
        raise PlanOptionError(f"--capacities needs capacities >= 0 blocks, got {text!r}")
    return values


def _prices(args: argparse.Namespace) -> TierPrices | None:
    from kvstrata.plan import PlanOptionError, TierPrices

    given = (args.price_device, args.price_host, args.price_storage)
    if all(p is None for p in given):
        return None
    if any(p is None for p in given):
        raise PlanOptionError("give all of --price-device, --price-host, --price-storage or none")
    return TierPrices(device=args.price_device, host=args.price_host, storage=args.price_storage)


def _size(blocks: int, tokens_per_block: int, bytes_per_block: int | None) -> str:
    text = f"{blocks:,} blocks ({blocks * tokens_per_block:,} tok"
    if bytes_per_block is not None:
        text += f", {blocks * bytes_per_block / 1e9:,.2f} GB"
    return text + ")"


def _curve_table(
    record: dict[str, object], curve: HitCurve, tokens_per_block: int, bytes_per_block: int | None
) -> Table:
    from rich.table import Table

    table = Table(
        title=(
            f"kvstrata plan: {record['source']}: {curve.num_requests:,} requests, "
            f"{curve.num_references:,} block references, {curve.num_distinct:,} distinct; "
            f"leaf-first LRU, curve in {record['curve_seconds']} s"
        )
    )
    table.add_column("capacity", justify="right")
    table.add_column("hit blocks", justify="right")
    table.add_column("hit rate", justify="right")
    rows = record["curve"]
    assert isinstance(rows, list)
    for row in rows:
        mark = " *" if row["page_lru_only"] else ""
        table.add_row(
            _size(row["capacity_blocks"], tokens_per_block, bytes_per_block) + mark,
            f"{row['hit_blocks']:,}",
            f"{row['hit_rate']:.2%}",
        )
    table.add_row("unbounded", f"{int(curve.hits[-1]):,}", f"{curve.ideal_hit_rate:.2%}")
    if any(row["page_lru_only"] for row in rows):
        table.caption = (
            f"* below the longest request ({curve.max_request_blocks:,} blocks): no tree can "
            "run the trace there; the figure is the page LRU's"
        )
    return table


def _plan_table(plan: TierPlan) -> Table:
    from rich.table import Table

    spec = plan.spec
    table = Table(
        title=(
            f"target {spec.target:.2%} (device alone >= {spec.device_target:.2%}, "
            f"device + host >= {spec.host_target:.2%}); inclusive LRU levels"
        )
    )
    table.add_column("combination", no_wrap=True)
    for level in ("device", "host", "storage"):
        table.add_column(level, justify="right")
    table.add_column("hit rate", justify="right")
    table.add_column("cost", justify="right")
    per_block = spec.bytes_per_block
    for combination in plan.combinations:
        cells: list[str] = []
        for name in ("device", "host", "storage"):
            level = combination.level(name)
            if level is None:
                cells.append("-")
                continue
            size = f"{level.blocks:,} blocks"
            if per_block is not None:
                size += f"\n{level.blocks * per_block / 1e9:,.1f} GB"
            cells.append(f"{size}\nhits {level.hit_rate:.2%}")
        mark = " (recommended)" if combination is plan.recommended else ""
        cost = "-" if combination.cost is None else f"{combination.cost:,.2f}"
        table.add_row(combination.combination + mark, *cells, f"{combination.hit_rate:.2%}", cost)
    return table
