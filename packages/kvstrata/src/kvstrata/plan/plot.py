"""`kvstrata plan --plot FILE.png`: the curve and the combinations, drawn with matplotlib.

Left: the LRU hit rate against capacity (log scale), the target, and the recommended sizes of
each level. Right: one line per combination of levels: its combined hit rate as its slowest
level grows (the faster ones at their planned sizes), against the cost of all levels (with
prices) or the blocks they store (copies included); the planned point of each is marked.
A `Figure` is drawn off-screen (Agg canvas), never through pyplot's global state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvstrata.plan.curve import HitCurve
from kvstrata.plan.sizing import CombinationPlan, TierPlan

_LEVEL_STYLES = {"device": "tab:green", "host": "tab:orange", "storage": "tab:purple"}


def capacity_grid(curve: HitCurve, *, points: int = 400) -> npt.NDArray[np.int64]:
    """Capacities 1 .. num_distinct, log-spaced (distinct, increasing)."""
    top = max(curve.num_distinct, 1)
    return np.unique(np.geomspace(1, top, num=points).round().astype(np.int64))


def plot_plan(curve: HitCurve, plan: TierPlan, path: Path, *, title: str) -> None:
    """Write the two panels to `path` (format from its suffix, PNG for `.png`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    grid = capacity_grid(curve)
    rates = curve.hit_rates(grid) * 100
    target = plan.spec.target * 100

    left.plot(grid, rates, color="black", label="LRU hit rate")
    left.axhline(target, color="tab:red", linestyle="--", label=f"target {target:.1f} %")
    for level in plan.recommended.levels:
        left.axvline(
            level.blocks,
            color=_LEVEL_STYLES[level.name],
            linestyle=":",
            label=f"{level.name}: {level.blocks:,} blocks",
        )
    left.set_xscale("log")
    left.set_xlabel("capacity (blocks)")
    left.set_ylabel("block hit rate (%)")
    left.set_title(f"recommended: {plan.recommended.combination}")
    left.legend(loc="upper left", fontsize="small")
    left.grid(True, which="both", alpha=0.3)

    prices = plan.spec.prices
    per_block = plan.spec.bytes_per_block
    for combination in plan.combinations:
        # The fastest levels at their planned sizes, the slowest one growing from its own.
        *fixed, top = combination.levels
        floor = fixed[-1].blocks if fixed else 1
        sizes = np.unique(np.concatenate(([top.blocks], grid[grid >= floor])))
        fixed_cost = sum(_weight(lv.name, lv.blocks, plan) for lv in fixed)
        xs = fixed_cost + _weight(top.name, 1, plan) * sizes
        right.plot(xs, curve.hit_rates(sizes) * 100, label=_label(combination))
        marker = "*" if combination is plan.recommended else "o"
        right.plot(
            [fixed_cost + _weight(top.name, top.blocks, plan)],
            [combination.hit_rate * 100],
            marker=marker,
            color=right.lines[-1].get_color(),
            markersize=12 if marker == "*" else 6,
        )
    right.axhline(target, color="tab:red", linestyle="--", label=f"target {target:.1f} %")
    right.set_xscale("log")
    if prices is not None and per_block is not None:
        right.set_xlabel("cost of all levels (price per GB x GB)")
    else:
        right.set_xlabel("blocks stored in all levels (copies included)")
    right.set_ylabel("combined block hit rate (%)")
    right.set_title("per combination: the slowest level grows (star: recommended)")
    right.legend(loc="lower right", fontsize="small")
    right.grid(True, which="both", alpha=0.3)

    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def _weight(level: str, blocks: int, plan: TierPlan) -> float:
    """What `blocks` blocks of `level` count on the x axis: their cost with prices, else the
    blocks themselves."""
    prices, per_block = plan.spec.prices, plan.spec.bytes_per_block
    if prices is None or per_block is None:
        return float(blocks)
    return blocks * per_block / 1e9 * prices.of(level)


def _label(combination: CombinationPlan) -> str:
    sizes = ", ".join(f"{lv.name} {lv.blocks:,}" for lv in combination.levels[:-1])
    grows = combination.levels[-1].name
    return f"{combination.combination}: {grows} grows" + (f" ({sizes})" if sizes else "")
