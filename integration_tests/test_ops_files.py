"""ops/: the Grafana board names only exported metrics, the Prometheus, Ray and KubeRay files
parse and carry what they must, and the kvstrata commands they run exist in the CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "ops"
DASHBOARD = OPS / "grafana" / "kvstrata.json"
PROMETHEUS = OPS / "prometheus" / "prometheus.yml"
CLUSTER = OPS / "ray" / "cluster.yaml"
KUBERAY = OPS / "kuberay" / "raycluster.yaml"
REFERENCE = ROOT / "docs" / "metrics.md"

_ROW = re.compile(r"^\| `(kvstrata_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|")


def exported() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from docs/metrics.md, which a test keeps equal to the code."""
    metrics: dict[str, tuple[str, set[str]]] = {}
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            labels = set(re.findall(r"`([a-z_]+)`", match.group(3)))
            metrics[match.group(1)] = (match.group(2), labels)
    return metrics


def _series(name: str, metrics: dict[str, tuple[str, set[str]]]) -> str | None:
    """The exported family a series name belongs to (histograms: _bucket, _sum, _count)."""
    if name in metrics:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and metrics.get(base, ("", set()))[0] == "histogram":
            return base
    return None


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _exprs() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in _dashboard()["panels"]
        for target in panel["targets"]
    ]


def test_reference_parses() -> None:
    metrics = exported()
    assert len(metrics) > 60
    assert metrics["kvstrata_host_transfer_seconds"][0] == "histogram"
    assert metrics["kvstrata_replay_hit_tokens_total"][1] == {"tier"}


def test_dashboard_structure() -> None:
    board = _dashboard()
    assert board["title"] and board["uid"] == "kvstrata"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) >= 8
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["datasource"]["type"] == "prometheus"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.parametrize(("title", "expr"), _exprs())
def test_every_panel_names_only_exported_metrics(title: str, expr: str) -> None:
    metrics = exported()
    names = re.findall(r"kvstrata_[a-z0-9_]+", expr)
    assert names, f"{title}: no kvstrata metric in {expr}"
    families = [_series(name, metrics) for name in names]
    unknown = [n for n, f in zip(names, families, strict=True) if f is None]
    assert not unknown, f"{title}: not exported: {unknown}"
    labels = {"le"}.union(*(metrics[f][1] for f in families if f is not None))
    for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr):
        used = {label.strip() for label in group.split(",") if label.strip()}
        assert used <= labels, f"{title}: {used - labels} is not a label of {families}"


def test_dashboard_covers_the_tiers() -> None:
    text = " ".join(expr for _, expr in _exprs())
    for needed in (
        "kvstrata_allocator_capacity_slots",  # device capacity and use
        "kvstrata_host_pool_capacity_tokens",  # host
        "kvstrata_storage_capacity_bytes",  # storage
        "kvstrata_replay_hit_tokens_total",  # hit rate per tier
        "kvstrata_tiered_cache_transfer_bytes_total",  # bytes per direction
        "histogram_quantile",  # latency percentiles
        "kvstrata_radix_evicted_tokens_total",  # eviction rate
    ):
        assert needed in text, needed


def _promtool() -> str | None:
    binary = shutil.which("promtool")
    if binary is None and os.environ.get("KVSTRATA_REQUIRE_PROMETHEUS") == "1":
        pytest.fail("KVSTRATA_REQUIRE_PROMETHEUS=1 but no promtool on PATH")
    return binary


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = _promtool()
    if promtool is None:
        pytest.skip("no promtool (Debian's prometheus package has it)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"kvstrata:panel_{i}",
                        "expr": expr.replace("$__rate_interval", "1m"),
                    }
                    for i, (_, expr) in enumerate(_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_config(tmp_path: Path) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"kvstrata-replay", "kvstrata-l3-store", "kvstrata-prefix-index"} <= set(jobs)
    # Target labels must not shadow a metric's own label (Prometheus would rename it).
    metric_labels = set().union(*(labels for _, labels in exported().values()))
    for job in jobs.values():
        target = set()
        for static in job.get("static_configs", []):
            target |= set(static.get("labels", {}))
        for relabel in job.get("relabel_configs", []):
            label = relabel.get("target_label", "")
            if not label.startswith("__"):
                target.add(label)
        assert not target & metric_labels, f"{job['job_name']}: {target & metric_labels}"
    ports = {
        name: {
            re.sub(r".*:", "", r["replacement"])
            for r in job.get("relabel_configs", [])
            if r.get("target_label") == "__address__"
        }
        for name, job in jobs.items()
    }
    assert ports["kvstrata-l3-store"] == {"9401"} and ports["kvstrata-prefix-index"] == {"9402"}
    promtool = _promtool()
    if promtool is not None:
        done = subprocess.run(
            [promtool, "check", "config", "--syntax-only", str(PROMETHEUS)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def _cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER.read_text(encoding="utf-8"))


def _kuberay() -> dict[str, Any]:
    return yaml.safe_load(KUBERAY.read_text(encoding="utf-8"))


def test_ray_cluster_launcher_config() -> None:
    cluster = _cluster()
    for key in ("cluster_name", "provider", "auth", "max_workers", "setup_commands"):
        assert key in cluster, key
    assert cluster["provider"]["type"]
    head = " && ".join(cluster["head_start_ray_commands"])
    assert "ray start --head" in head and "--metrics-export-port" in head
    assert "ops/prometheus/prometheus.yml" in head  # the head runs the scrape config
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("kvstrata services up" in c for c in cluster[commands]), commands


def test_kuberay_manifest() -> None:
    manifest = _kuberay()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for group in groups:
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams are strings"
        assert params["metrics-export-port"] == "8080"
        pod = group["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        containers = pod["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
        ports = {p["name"]: p["containerPort"] for p in containers[0]["ports"]}
        assert ports["kvstrata-l3"] == 9401 and ports["kvstrata-index"] == 9402
        assert ports["metrics"] == 8080
        command = containers[0]["lifecycle"]["postStart"]["exec"]["command"]
        assert "kvstrata services up" in command[-1]


def _shell_commands() -> Iterator[str]:
    cluster = _cluster()
    for key in (
        "setup_commands",
        "head_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        yield from cluster.get(key, [])
    spec = _kuberay()["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            yield container["lifecycle"]["postStart"]["exec"]["command"][-1]


def kvstrata_commands() -> list[list[str]]:
    """Every `kvstrata ...` invocation of the Ray and KubeRay files, as argv after `kvstrata`."""
    found: list[list[str]] = []
    for line in _shell_commands():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part)
            if words and Path(words[0]).name == "kvstrata" and words[1:] not in found:
                found.append(words[1:])
    return found


def test_the_files_run_kvstrata_commands() -> None:
    assert ["services", "up"] in kvstrata_commands()


def _subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:  # argparse keeps subparsers only here
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            return set(choices)
    raise AssertionError("the kvstrata parser has no subcommands")


@pytest.mark.parametrize("argv", kvstrata_commands(), ids=" ".join)
def test_each_command_exists_in_the_cli(argv: list[str]) -> None:
    if argv[0] not in _subcommands():
        pytest.skip(f"`kvstrata {argv[0]}` is not in the CLI yet (the services add it)")
    build_parser().parse_args(argv)  # SystemExit(2) on an unknown subcommand or option
