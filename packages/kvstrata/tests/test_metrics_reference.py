"""docs/metrics.md is generated from the collectors, and every metric follows the naming rules."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.replay.reference import (
    ALLOWED_LABELS,
    TARGET_LABELS,
    MetricDoc,
    UndocumentedCollector,
    discover_collectors,
    reference_metrics,
    render,
)

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "docs" / "metrics.md"
REGENERATE = "uv run python -m kvstrata.replay.reference docs/metrics.md"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def docs() -> list[MetricDoc]:
    return reference_metrics()


def test_the_committed_reference_is_the_generated_one(docs: list[MetricDoc]) -> None:
    committed = REFERENCE.read_text(encoding="utf-8")
    assert committed == render(docs), f"docs/metrics.md is stale: run `{REGENERATE}`"


def test_every_member_collector_is_discovered() -> None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in discover_collectors()}
    assert {
        "kvstrata.allocator.metrics.AllocatorCollector",
        "kvstrata.hybrid_cache.metrics.TierControllerCollector",
        "kvstrata.pool.metrics.PoolCollector",
        "kvstrata.pool_host.metrics.HostPoolCollector",
        "kvstrata.replay.metrics.ReplayCollector",
        "kvstrata.storage.metrics.StorageCollector",
        "kvstrata.unified_radix_cache.metrics.RadixCacheCollector",
        "kvstrata.unified_radix_cache.tier_metrics.TierCacheCollector",
    } <= names


_FORBIDDEN_UNITS = re.compile(
    r"_(ms|us|ns|millis|micros|minutes|hours|kb|mb|gb|kib|mib|gib|percent|ratio)(_|$)"
)


def test_names_follow_the_rules(docs: list[MetricDoc]) -> None:
    for doc in docs:
        assert doc.name.startswith("kvstrata_"), doc.name
        assert re.fullmatch(r"kvstrata_[a-z0-9_]+", doc.name), doc.name
        assert not _FORBIDDEN_UNITS.search(doc.name), f"{doc.name}: use base units"
        if doc.type == "counter":
            assert doc.name.endswith("_total") and not doc.name.endswith("_total_total")
        else:
            assert not doc.name.endswith("_total"), f"{doc.name}: only counters end in _total"
        if doc.type == "histogram":
            assert doc.name.endswith("_seconds"), f"{doc.name}: histograms time in seconds"
        assert doc.help.strip(), f"{doc.name} has no help text"


def test_labels_are_allowed_and_bounded(docs: list[MetricDoc]) -> None:
    for doc in docs:
        for label in doc.labels:
            assert label not in TARGET_LABELS, f"{doc.name}: {label} is a target label"
            assert label in ALLOWED_LABELS, f"{doc.name}: label {label} is not in the rules"
            values = doc.label_values[label]
            assert len(values) <= 16, f"{doc.name}{{{label}}} takes {len(values)} values"


def test_one_name_per_concept(docs: list[MetricDoc]) -> None:
    by_name = {d.name: d for d in docs}
    # Bytes moved between tiers: one suffix and the same direction values in every layer.
    for name in (
        "kvstrata_tier_transfer_bytes_total",
        "kvstrata_tiered_cache_transfer_bytes_total",
        "kvstrata_host_transfer_bytes_total",
    ):
        assert "direction" in by_name[name].labels
        assert by_name[name].label_values["direction"] <= {
            "d2h",
            "h2d",
            "storage_get",
            "storage_set",
        }
    for name in (
        "kvstrata_replay_hit_tokens_total",
        "kvstrata_tiered_cache_hit_tokens_total",
        "kvstrata_radix_hit_tokens_total",
    ):
        assert by_name[name].label_values["tier"] <= {"device", "host", "storage"}
    assert not [d.name for d in docs if re.search(r"_(d2h|h2d)_", d.name)]


def _metric_literals() -> Iterator[tuple[Path, str]]:
    """Every string constant (f-string pieces included) that looks like a metric name or a
    prefix of one, in the src trees."""
    roots = [*ROOT.glob("packages/*/src"), *ROOT.glob("services/*/src")]
    for root in roots:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                # f-string heads are Constant nodes too: both forms come through here.
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and re.fullmatch(r"kvstrata_[a-z0-9_]+", node.value)
                ):
                    yield path, node.value


def test_every_metric_name_in_the_code_is_in_the_reference(docs: list[MetricDoc]) -> None:
    names = [d.name for d in docs]
    literals = list(_metric_literals())
    assert len(literals) > 40  # the scan sees the collectors
    missing = [
        f"{path.relative_to(ROOT)}: {text}"
        for path, text in literals
        if not any(name.startswith(text) for name in names)
    ]
    assert not missing, f"metric names the reference does not list (run `{REGENERATE}`): {missing}"


class _Undocumented(Collector):
    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvstrata_fake_things", "Things.")


class _Documented(_Undocumented):
    @classmethod
    def reference_collectors(cls) -> list[Collector]:
        return [cls()]


def test_a_collector_without_an_example_is_an_error() -> None:
    with pytest.raises(UndocumentedCollector, match="_Undocumented"):
        reference_metrics([_Undocumented])


def test_a_service_collector_documents_itself_through_reference_collectors() -> None:
    docs = reference_metrics([_Documented])
    assert [(d.name, d.type, d.source.rsplit(".", 1)[-1]) for d in docs] == [
        ("kvstrata_fake_things_total", "counter", "_Documented")
    ]
