"""The default main job (device, + host, + host and storage side by side), `--plot` and the
metrics endpoint of `kvstrata replay`."""

from __future__ import annotations

import json
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.cli.main import main
from kvstrata.replay import WorkloadSpec, generate_workload
from kvstrata.replay.compare import TierConfig, default_configs, run_configuration
from kvstrata.replay.errors import ReplayOptionError
from kvstrata.replay.exporter import MetricsServer
from kvstrata.replay.plot import expected_lines, plot_runs

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_default_compares_three_configurations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "tiers.png"
    argv = ["replay", "--limit", "60", "--no-progress", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    configs = document["configurations"]
    assert [c["configuration"] for c in configs] == [
        "device",
        "device+host",
        "device+host+storage",
    ]
    device, host, storage = configs
    # One device size for all three, too small for the workload: the device alone evicts.
    assert device["capacity_tokens"] == host["capacity_tokens"] == storage["capacity_tokens"]
    assert device["evicted_tokens"] > 0 and device["unbounded"] is False
    assert device["requests"] == host["requests"] == storage["requests"] == 60
    # Tiers below the device only add hits; each tier's share sums to the total.
    assert device["hit_rate"] <= host["hit_rate"] <= storage["hit_rate"]
    assert host["host_hit_tokens"] > 0 and storage["storage_hit_tokens"] > 0
    for c in (host, storage):
        assert (
            c["device_hit_tokens"] + c["host_hit_tokens"] + c["storage_hit_tokens"]
            == (c["hit_tokens"])
        )
    assert host["storage"] is None and storage["bytes_storage_set"] > 0
    text = capsys.readouterr().out
    for row in ("hit rate: device", "hit rate: host", "hit rate: storage", "cache operations"):
        assert row in text
    for column in ("device+host+storage", "device+host"):
        assert column in text
    assert f"+{storage['hit_tokens'] - device['hit_tokens']:,}" in text
    assert _png_size(png) == (1500, 800)
    assert png.stat().st_size > 20_000  # drawn lines and text, not an empty canvas


def test_plot_draws_one_line_per_configuration_and_tier(tmp_path: Path) -> None:
    requests = generate_workload(WorkloadSpec(seed=1))[:40]
    configs = default_configs(requests, page_size=16)
    runs = [
        run_configuration(c, requests, family="mha", policy="lru", page_size=16, sample_every=8)
        for c in configs
    ]
    assert all(len(run.samples) == 40 // 8 + 1 for run in runs)  # every 8, then the end
    path = tmp_path / "plot.png"
    figure = plot_runs(runs, path)
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    # device: 3 configurations, host: 2, storage: 1; a hit-rate and a capacity panel each.
    assert len(lines) == expected_lines(runs) == 12
    labels = sorted(str(line.get_label()) for line in figure.axes[2].get_lines())
    assert labels == ["device+host+storage"]
    for line in lines:
        ys = [float(y) for y in line.get_ydata()]  # pyright: ignore[reportGeneralTypeIssues]
        assert all(0.0 <= y <= 1.0 for y in ys)
    assert _png_size(path) == (1500, 800)
    with pytest.raises(ReplayOptionError, match=r"must end in \.png"):
        plot_runs(runs, tmp_path / "plot.svg")
    with pytest.raises(ReplayOptionError, match="nothing to plot"):
        plot_runs([], path)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_server_serves_every_layer_under_the_config_label() -> None:
    requests = generate_workload(WorkloadSpec(seed=2))[:30]
    config = TierConfig(
        name="device+host+storage",
        capacity_tokens=4096,
        host_ratio=2.0,
        storage_url="memory://?capacity_bytes=100000000",
        prefetch_threshold=16,
    )
    registry = CollectorRegistry()
    server = MetricsServer(registry, port=0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        run = run_configuration(
            config, requests, family="mha", policy="lru", page_size=16, registry=registry
        )
        samples = _scrape(server.url)
    finally:
        server.close()
    tiers = run.stats.tiers
    assert tiers is not None

    def value(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"config": config.name, **labels}.items())))
        return samples[key]

    assert value("kvstrata_replay_requests_total") == 30
    for tier in ("device", "host", "storage"):
        assert value("kvstrata_replay_hit_tokens_total", tier=tier) == getattr(
            tiers, f"{tier}_hit_tokens"
        )
    for direction in ("d2h", "h2d", "storage_get", "storage_set"):
        assert value("kvstrata_tiered_cache_transfer_bytes_total", direction=direction) == (
            getattr(tiers, f"bytes_{direction}")
        )
    assert value("kvstrata_replay_evicted_tokens_total") == run.stats.evicted_tokens
    # Every layer answers: pools, allocators, tree, host mirrors, controller, storage.
    prefixes = {name.split("_")[1] for name, _ in samples}
    assert {"replay", "radix", "pool", "allocator", "tiered", "host", "tier", "storage"} <= (
        prefixes
    )
    with pytest.raises(OSError):  # closed: the port no longer answers
        urllib.request.urlopen(server.url, timeout=2)


def test_metrics_server_refuses_bad_addresses() -> None:
    with pytest.raises(ReplayOptionError, match="IP address"):
        MetricsServer(CollectorRegistry(), port=0, addr="not-an-ip")
    with pytest.raises(ReplayOptionError, match=r"0\.\.65535"):
        MetricsServer(CollectorRegistry(), port=-1)


def test_cli_serves_while_holding_then_frees_the_port(tmp_path: Path) -> None:
    import socket
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = tmp_path / "one.json"
    argv = ["replay", "--unbounded", "--limit", "5", "--no-progress", "--json", str(out)]
    argv += ["--metrics-port", str(port), "--metrics-hold", "3"]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(argv)))
    started = time.monotonic()
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = _scrape(f"http://127.0.0.1:{port}/metrics")  # the run is over: holding
        assert thread.is_alive()
        key = ("kvstrata_replay_requests_total", (("config", "device"),))
        assert samples[key] == 5
    finally:
        thread.join(timeout=60)
    assert codes == [0]
    assert time.monotonic() - started >= 3
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
