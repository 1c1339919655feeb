"""A real Prometheus scrapes `kvstrata replay --metrics-port` with ops/prometheus/prometheus.yml.

The repository's scrape configuration is rewritten to this test's ports (the replay job's static
target, Ray's discovery file replaced by an empty one in a temp folder) and a 1 s scrape
interval; Prometheus (Debian's `prometheus` package, which .ci/run installs) runs on loopback
with its data in a temp folder; a tiered replay serves its metrics and holds them after it
ends; the test then asks Prometheus's HTTP API for hit tokens per tier, bytes moved per
direction and evictions, and compares them with the replay's own JSON summary.

Skipped when there is no `prometheus` binary, unless KVSTRATA_REQUIRE_PROMETHEUS=1 (set by
.ci/run), which turns the skip into a failure. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "ops" / "prometheus" / "prometheus.yml"
REPLAY_JOB = "kvstrata-replay"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("KVSTRATA_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("KVSTRATA_REQUIRE_PROMETHEUS=1 but no prometheus binary on PATH")
        pytest.skip("no prometheus binary (apt-get install prometheus; .ci/run does)")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], Any], *, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def rewrite_config(
    source: dict[str, Any], *, replay_target: str, discovery_file: Path
) -> dict[str, Any]:
    """The repository's configuration with a 1 s scrape, the replay job pointed at
    `replay_target` and every file-based discovery reading `discovery_file`."""
    config = json.loads(json.dumps(source))  # a deep copy
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs[REPLAY_JOB]["static_configs"][0]["targets"] = [replay_target]
    for job in jobs.values():
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(discovery_file)]
    return config


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(Prometheus base URL, the replay's metrics port) with Prometheus running."""
    binary = _prometheus()
    folder = tmp_path_factory.mktemp("prometheus")
    replay_port, web_port = _free_port(), _free_port()
    discovery = folder / "discovery.json"
    # What Ray's head writes: one "<node ip>:<metrics export port>" per node, job="ray".
    ray_targets = [{"labels": {"job": "ray"}, "targets": ["127.0.0.1:8080"]}]
    discovery.write_text(json.dumps(ray_targets) + "\n", encoding="utf-8")
    source = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    config = rewrite_config(
        source, replay_target=f"127.0.0.1:{replay_port}", discovery_file=discovery
    )
    config_file = folder / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = (folder / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )
    base = f"http://127.0.0.1:{web_port}"
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(
                    f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}"
                )
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                return response.status == 200

        _wait("prometheus to be ready", ready, timeout=60)
        yield base, replay_port
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def test_ray_discovery_file_becomes_one_target_per_service(prometheus: tuple[str, int]) -> None:
    base, _ = prometheus

    def targets() -> dict[str, dict[str, str]]:
        with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as response:
            active = json.load(response)["data"]["activeTargets"]
        return {t["labels"]["job"]: t["labels"] for t in active if "service" in t["labels"]}

    found = _wait("the discovered targets", lambda: len(targets()) >= 3 and targets(), timeout=30)
    for job, port, service in (
        ("kvstrata-l3-store", "9401", "l3-store"),
        ("kvstrata-prefix-index", "9402", "prefix-index"),
    ):
        assert found[job]["instance"] == f"127.0.0.1:{port}"
        assert found[job]["node"] == "127.0.0.1" and found[job]["service"] == service
    assert found["kvstrata-replay"]["service"] == "engine"


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _value(base: str, expr: str) -> float:
    result = _query(base, expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def test_config_rewrite_keeps_every_job(tmp_path: Path) -> None:
    source = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    config = rewrite_config(source, replay_target="127.0.0.1:1", discovery_file=tmp_path / "d")
    assert [j["job_name"] for j in config["scrape_configs"]] == [
        j["job_name"] for j in source["scrape_configs"]
    ]
    assert REPLAY_JOB in {j["job_name"] for j in source["scrape_configs"]}
    assert config["global"]["scrape_interval"] == "1s"
    assert source["global"]["scrape_interval"] != "1s"  # the copy, not the source, changed


def test_prometheus_agrees_with_the_replay_summary(
    prometheus: tuple[str, int], tmp_path: Path
) -> None:
    base, port = prometheus
    summary = tmp_path / "replay.json"
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "replay",
            "--no-progress",
            "--limit",
            "120",
            "--capacity-tokens",
            "4096",
            "--host-ratio",
            "2",
            "--storage",
            "memory://?capacity_bytes=200000000",
            "--prefetch-threshold",
            "16",
            "--json",
            str(summary),
            "--metrics-port",
            str(port),
            "--metrics-hold",
            "60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = f'job="{REPLAY_JOB}"'
        # Scraped while it runs: the target is up before the summary exists.
        _wait("the replay target to be up", lambda: _query(base, f"up{{{job}}} == 1"), timeout=60)

        def finished() -> bool:
            if replay.poll() is not None:
                raise AssertionError(f"replay exited early: {replay.communicate()[1]}")
            return summary.exists() and summary.stat().st_size > 0

        _wait("the replay summary", finished, timeout=150)
        record = json.loads(summary.read_text(encoding="utf-8"))
        written = summary.stat().st_mtime
        # A scrape that started after the summary was written sees the final counters.
        _wait(
            "a scrape after the summary",
            lambda: _value(base, f"timestamp(kvstrata_replay_requests_total{{{job}}})") > written,
            timeout=30,
        )
        assert _value(base, f"kvstrata_replay_requests_total{{{job}}}") == record["requests"] == 120
        for tier in ("device", "host", "storage"):
            expr = f'kvstrata_replay_hit_tokens_total{{{job},tier="{tier}"}}'
            assert _value(base, expr) == record[f"{tier}_hit_tokens"], tier
        assert record["host_hit_tokens"] > 0 and record["storage_hit_tokens"] > 0
        for direction in ("d2h", "h2d", "storage_get", "storage_set"):
            expr = f'kvstrata_tiered_cache_transfer_bytes_total{{{job},direction="{direction}"}}'
            assert _value(base, expr) == record[f"bytes_{direction}"], direction
        assert record["bytes_storage_set"] > 0
        evicted = _value(base, f"kvstrata_replay_evicted_tokens_total{{{job}}}")
        assert evicted == record["evicted_tokens"] > 0
        # The tree's own eviction counter (cascades included) covers the replay's.
        tree = f'kvstrata_radix_evicted_tokens_total{{{job},component="full"}}'
        assert _value(base, tree) >= evicted
        # Every panel of the Grafana board answers from this scrape, with at least one series.
        board = json.loads((ROOT / "ops" / "grafana" / "kvstrata.json").read_text("utf-8"))
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "30s")
                assert _query(base, expr), f"{panel['title']}: no series for {expr}"
        # Every sample carries the configuration's name.
        configs = _query(base, f"count by (config) (kvstrata_replay_requests_total{{{job}}})")
        assert [r["metric"]["config"] for r in configs] == ["device+host+storage"]
    finally:
        replay.terminate()
        try:
            replay.wait(timeout=20)
        except subprocess.TimeoutExpired:
            replay.kill()
            replay.wait(timeout=10)
