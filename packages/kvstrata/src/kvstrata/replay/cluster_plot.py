"""`kvstrata replay --instances N --plot FILE.png`: per-instance load and hit rate over time."""

from __future__ import annotations

from pathlib import Path

from kvstrata.replay.cluster import ClusterReport

#: Requests per point of the hit-rate lines (a moving window over each instance's requests).
HIT_WINDOW = 200


def plot_cluster(report: ClusterReport, path: Path) -> None:
    """Two panels against trace time: in-flight load (prompt pages) of every instance at each
    arrival, and each instance's block hit rate over its last `HIT_WINDOW` requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load_ax, hit_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    times = [row[0] for row in report.timeline]
    for k, inst in enumerate(report.instances):
        load_ax.plot(times, [row[4][k] for row in report.timeline], lw=0.6, label=inst.name)
        rows = [row for row in report.timeline if row[1] == k]
        xs: list[float] = []
        ys: list[float] = []
        pages = hits = 0
        for j, row in enumerate(rows):
            pages += row[2]
            hits += row[3]
            if j >= HIT_WINDOW:
                pages -= rows[j - HIT_WINDOW][2]
                hits -= rows[j - HIT_WINDOW][3]
            xs.append(row[0])
            ys.append(100.0 * hits / pages if pages else 0.0)
        hit_ax.plot(xs, ys, lw=0.8, label=inst.name)
    load_ax.set_ylabel("in-flight prompt pages")
    load_ax.set_title(
        f"{report.num_instances} instances, router {report.router}: "
        f"hit rate {100 * report.hit_rate:.2f} % (pooled {100 * report.pooled_hit_rate:.2f} %), "
        f"max/mean load {report.max_load_ratio:.3f}"
    )
    hit_ax.set_ylabel(f"hit rate, last {HIT_WINDOW} requests (%)")
    hit_ax.set_xlabel("trace time (s)")
    if report.num_instances <= 16:
        load_ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
