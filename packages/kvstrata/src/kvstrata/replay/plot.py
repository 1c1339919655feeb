"""`kvstrata replay --plot FILE.png`: hit rate and capacity use per tier over the requests.

One figure, two rows of one panel per tier (device, host, storage): on top the hit rate of each
sampling window (hit tokens from that tier / prompt tokens of the window's requests), below the
share of the tier's capacity in use after the window. Each configuration that has a tier draws
one line in that tier's panels, in the same colour and dash everywhere (later configurations
thinner, so coinciding lines stay visible). Rendered with matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.replay.compare import TIERS, ConfigRun
from kvstrata.replay.errors import ReplayOptionError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["expected_lines", "plot_runs"]


def expected_lines(runs: Sequence[ConfigRun]) -> int:
    """Lines `plot_runs` draws: per tier, one hit-rate and one capacity line per run that has
    that tier (a run with no sample draws none)."""
    return sum(2 * len(run.config.tiers) for run in runs if run.samples)


def plot_runs(runs: Sequence[ConfigRun], path: Path, *, dpi: int = 100) -> Figure:
    """Draw `runs` into the PNG `path` and return the figure (closed: for inspection only).

    Raises ReplayOptionError for a path that does not end in .png or an empty `runs`, before
    drawing; OSError when the file cannot be written."""
    if path.suffix.lower() != ".png":
        raise ReplayOptionError(f"--plot writes a PNG: the file name must end in .png, got {path}")
    if not runs:
        raise ReplayOptionError("nothing to plot: no configuration was replayed")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 8), dpi=dpi, layout="constrained")
    axes = figure.subplots(2, len(TIERS), sharex=True)
    # Configurations often coincide on a tier (the device sees the same requests with or without
    # tiers below it): later lines are thinner and dashed, so the ones beneath stay visible.
    styles = [
        (f"C{i}", ("-", "--", ":", "-.")[i % 4], max(2.8 - 0.8 * i, 0.8)) for i in range(len(runs))
    ]
    for column, tier in enumerate(TIERS):
        hit_ax, use_ax = axes[0][column], axes[1][column]
        hit_ax.set_title(f"{tier}: hit rate per window")
        use_ax.set_title(f"{tier}: capacity in use")
        hit_ax.set_ylim(0.0, 1.0)
        use_ax.set_ylim(0.0, 1.05)
        use_ax.set_xlabel("requests")
        for run, (colour, style, width) in zip(runs, styles, strict=True):
            if tier not in run.config.tiers or not run.samples:
                continue
            x = [s.requests for s in run.samples]
            rates: list[float] = []
            previous_prompt = previous_hit = 0
            for s in run.samples:
                prompt = s.prompt_tokens - previous_prompt
                hit = s.hit_tokens[tier] - previous_hit
                rates.append(hit / prompt if prompt else 0.0)
                previous_prompt, previous_hit = s.prompt_tokens, s.hit_tokens[tier]
            used = [s.used_share[tier] or 0.0 for s in run.samples]
            line = {"color": colour, "linestyle": style, "linewidth": width}
            hit_ax.plot(x, rates, label=run.config.name, **line)
            use_ax.plot(x, used, label=run.config.name, **line)
        if hit_ax.lines:
            hit_ax.legend(loc="lower right", fontsize="small")
    axes[0][0].set_ylabel("hit tokens / prompt tokens")
    axes[1][0].set_ylabel("used / capacity")
    figure.suptitle("kvstrata replay: where prefixes are found, and how full each tier is")
    figure.savefig(path, format="png")
    return figure
