"""A real Prometheus scrapes `kvstrata replay --metrics-port` with ops/prometheus/prometheus.yml.

The repository's scrape configuration is rewritten to this test's ports (the replay job's static
target, Ray's discovery file replaced by an empty one in a temp folder) and a 1 s scrape
interval; Prometheus (Debian's `prometheus` package, which .ci/run installs) runs on loopback
with its data in a temp folder; a tiered replay serves its metrics and holds them after it
ends; the test then asks Prometheus's HTTP API for hit tokens per tier, bytes moved per
direction and evictions, and compares them with the replay's own JSON summary. The two Ray
services' collectors (a live L3 store core and a prefix index shard, no Ray) are served from
this process on the ports the rewritten relabelling swaps in, as their actors serve them on a
node, so the services' jobs, their `node` label and the dashboard's service panels are checked
against a real scrape too.

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
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector

from kvstrata.l3_store.arena import ALIGNMENT
from kvstrata.l3_store.core import StoreCore, StoreParams
from kvstrata.l3_store.metrics import StoreCollector
from kvstrata.prefix_index.cluster import IndexShard
from kvstrata.unified_radix_cache import BlockStored, encode_events

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
    source: dict[str, Any],
    *,
    replay_target: str,
    discovery_file: Path,
    service_ports: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The repository's configuration with a 1 s scrape, the replay job pointed at
    `replay_target`, every file-based discovery reading `discovery_file`, and each service
    job's relabelled port replaced by `service_ports[job]`."""
    config = json.loads(json.dumps(source))  # a deep copy
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs[REPLAY_JOB]["static_configs"][0]["targets"] = [replay_target]
    for job in jobs.values():
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(discovery_file)]
    for name, port in (service_ports or {}).items():
        rules = [r for r in jobs[name]["relabel_configs"] if r.get("target_label") == "__address__"]
        assert len(rules) == 1, f"{name}: one __address__ rule expected"
        rules[0]["replacement"] = f"$1:{port}"
    return config


class Services:
    """The services' collectors over live state, each served on its own loopback port."""

    PAGE = 16

    def __init__(self) -> None:
        self.store = StoreCore(
            StoreParams(memory_bytes=8 * ALIGNMENT), arena=memoryview(bytearray(8 * ALIGNMENT))
        )
        keys = [f"page-{i:011d}".encode() for i in range(3)]
        self.store.write(keys, [bytes(ALIGNMENT)] * 3)
        self.store.read([keys[0], b"page-not-stored"])
        self.shard = IndexShard(self.PAGE)
        pages = self.shard.index.page_keys(list(range(5 * self.PAGE)))
        stored = BlockStored(page_keys=tuple(pages), parent_key=None, tokens_per_page=self.PAGE)
        assert self.shard.apply_batches([("engine-0", 0, encode_events([stored]))]) == [True]
        self.shard.match_batch([pages[:2], pages, pages[:1]])
        self._servers = [
            self._serve(StoreCollector(self.store.stats)),
            self._serve(self.shard.collector()),
        ]
        self.ports = {
            "kvstrata-l3-store": self._servers[0].server_port,
            "kvstrata-prefix-index": self._servers[1].server_port,
        }

    @staticmethod
    def _serve(collector: Collector) -> Any:
        registry = CollectorRegistry()
        registry.register(collector)
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        return server

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    served = Services()
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, services: Services
) -> Iterator[tuple[str, int]]:
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
        source,
        replay_target=f"127.0.0.1:{replay_port}",
        discovery_file=discovery,
        service_ports=services.ports,
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


def test_ray_discovery_file_becomes_one_target_per_service(
    prometheus: tuple[str, int], services: Services
) -> None:
    base, _ = prometheus

    def targets() -> dict[str, dict[str, str]]:
        with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as response:
            active = json.load(response)["data"]["activeTargets"]
        return {t["labels"]["job"]: t["labels"] for t in active if "service" in t["labels"]}

    found = _wait("the discovered targets", lambda: len(targets()) >= 3 and targets(), timeout=30)
    for job, service in (
        ("kvstrata-l3-store", "l3-store"),
        ("kvstrata-prefix-index", "prefix-index"),
    ):
        assert found[job]["instance"] == f"127.0.0.1:{services.ports[job]}"
        assert found[job]["node"] == "127.0.0.1" and found[job]["service"] == service
    assert found["kvstrata-replay"]["service"] == "engine"


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _value(base: str, expr: str) -> float:
    # A scrape that times out on a loaded machine (the timeout is the 1 s interval) marks the
    # target's series stale until the next one succeeds: an empty answer is retried for 10 s.
    result = _wait(f"a series for {expr}", partial(_query, base, expr), timeout=10)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def test_config_rewrite_keeps_every_job(tmp_path: Path) -> None:
    source = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    config = rewrite_config(
        source,
        replay_target="127.0.0.1:1",
        discovery_file=tmp_path / "d",
        service_ports={"kvstrata-l3-store": 2, "kvstrata-prefix-index": 3},
    )
    assert [j["job_name"] for j in config["scrape_configs"]] == [
        j["job_name"] for j in source["scrape_configs"]
    ]
    assert REPLAY_JOB in {j["job_name"] for j in source["scrape_configs"]}
    assert config["global"]["scrape_interval"] == "1s"
    assert source["global"]["scrape_interval"] != "1s"  # the copy, not the source, changed
    ports = {
        job["job_name"]: rule["replacement"]
        for job in config["scrape_configs"]
        for rule in job.get("relabel_configs", [])
        if rule.get("target_label") == "__address__"
    }
    assert ports == {"kvstrata-l3-store": "$1:2", "kvstrata-prefix-index": "$1:3"}


def test_the_services_are_scraped_per_node(prometheus: tuple[str, int], services: Services) -> None:
    base, _ = prometheus
    l3 = 'job="kvstrata-l3-store"'
    index = 'job="kvstrata-prefix-index"'
    _wait("the services' series", lambda: _query(base, f"up{{{l3}}} + on() up{{{index}}} == 2"),
          timeout=30)  # fmt: skip
    stats = services.store.stats()
    used = _query(base, f'kvstrata_l3_store_used_bytes{{{l3},medium="memory"}}')
    assert [r["metric"]["node"] for r in used] == ["127.0.0.1"]
    assert float(used[0]["value"][1]) == stats.memory_used_bytes == 3 * ALIGNMENT
    moved = f'kvstrata_l3_store_transfer_bytes_total{{{l3},direction="storage_get"}}'
    assert _value(base, moved) == stats.bytes_read == ALIGNMENT
    assert _value(base, f"kvstrata_prefix_index_entries{{{index}}}") == len(services.shard.index)
    assert _value(base, f"kvstrata_prefix_index_lookups_total{{{index}}}") == 3
    assert _value(base, f'kvstrata_prefix_index_events_total{{{index},kind="stored"}}') == 1
    assert _value(base, f"kvstrata_prefix_index_lookup_seconds_count{{{index}}}") == 1


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
        # Every panel of the Grafana board answers from this scrape, with at least one series. A
        # rate() needs two samples in its window: a replay that finished within one scrape
        # interval has one at first, so each panel gets a few scrapes to answer.
        board = json.loads((ROOT / "ops" / "grafana" / "kvstrata.json").read_text("utf-8"))
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "30s")
                _wait(
                    f"{panel['title']}: a series for {expr}",
                    partial(_query, base, expr),
                    timeout=15,
                )
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
