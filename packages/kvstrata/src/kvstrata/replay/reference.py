"""The metrics reference (`docs/metrics.md`), generated from the collectors themselves.

`discover_collectors()` imports every module of the `kvstrata` namespace whose name ends in
`metrics` (members and services alike) and returns every `prometheus_client` `Collector`
subclass defined there. `reference_metrics()` then reads real families from each:

- the members' collectors, from short tiered replays (device + host + storage) of each model
  family (mha, swa, mamba), built exactly as `kvstrata replay --metrics-port` builds them;
- any other collector class (the Ray services'), from the collectors its
  `reference_collectors()` classmethod returns: small live instances, the same as the service
  builds.

A collector class that neither covers is an error (`UndocumentedCollector`), so a new
collector cannot land without its rows in the reference. `render()` writes the Markdown; a test
compares it with the committed file. Regenerate with:

    uv run python -m kvstrata.replay.reference docs/metrics.md
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.registry import Collector

import kvstrata
from kvstrata.pool import ReqToTokenPool
from kvstrata.pool.metrics import PoolCollector
from kvstrata.replay.compare import TierConfig, run_configuration
from kvstrata.replay.errors import ReplayError
from kvstrata.replay.exporter import ConfigCollector
from kvstrata.replay.workload import WorkloadSpec, generate_workload

__all__ = [
    "ALLOWED_LABELS",
    "MetricDoc",
    "UndocumentedCollector",
    "discover_collectors",
    "reference_metrics",
    "render",
]

#: Labels a kvstrata metric may carry, and what each means (the naming rules' label list).
ALLOWED_LABELS: dict[str, str] = {
    "tier": "device, host or storage",
    "pool": "a pool by the name the application gives it (`kv`, `kv.full`, `state`, `full`, ...)",
    "component": "a radix tree component: full, swa, mamba",
    "direction": "d2h, h2d, storage_get, storage_set (pool page I/O: read, write)",
    "state": "free, used, evictable, protected, held",
    "allocator": "an allocator by the name the application gives it",
    "controller": "a tier controller by the name the application gives it",
    "storage": "a storage backend by the name the application gives it",
    "member": "a pool group member: full, swa, mamba",
    "kind": "an operation kind of the tier controller",
    "status": "how an operation ended",
    "reason": "why a storage call ended early",
    "outcome": "started or skipped",
    "operation": "a storage batch call: exists, get, set, delete",
    "phase": "cache or forward (the replay's time)",
    "family": "the model family of a host pool: mha, mamba",
    "layout": "the host pool's memory layout",
}

#: Labels that come from the scrape, never from a collector: a collector label of the same name
#: would be renamed `exported_<name>` by Prometheus.
TARGET_LABELS: tuple[str, ...] = ("instance", "job", "node", "namespace", "service")

#: Model families the reference replays, so every component's families appear.
_FAMILIES: tuple[str, ...] = ("mha", "swa", "mamba")


class UndocumentedCollector(ReplayError):
    """A collector class that the reference cannot read: neither the replay builds it nor does
    it define `reference_collectors()`."""


@dataclass
class MetricDoc:
    """One metric family as the reference lists it. `name` is the exposed name (a counter's
    with `_total`); `label_values` the values seen in the reference runs, per label."""

    name: str
    type: str
    help: str
    source: str
    labels: list[str] = field(default_factory=list)
    label_values: dict[str, set[str]] = field(default_factory=dict)


def discover_collectors() -> list[type[Collector]]:
    """Every Collector subclass defined in a `kvstrata.*metrics` module, sorted by path."""
    for info in pkgutil.walk_packages(kvstrata.__path__, "kvstrata."):
        if info.name.rsplit(".", 1)[-1].endswith("metrics"):
            importlib.import_module(info.name)
    found: set[type[Collector]] = set()
    stack = list(Collector.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        module = cls.__module__
        if module.startswith("kvstrata.") and module.rsplit(".", 1)[-1].endswith("metrics"):
            found.add(cls)
    return sorted(found, key=_path)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _member_examples() -> Iterator[Collector]:
    """The collectors of short tiered replays of every family (and a request table)."""
    requests = generate_workload(WorkloadSpec(seed=0))[:12]
    for family in _FAMILIES:
        config = TierConfig(
            name=family,
            capacity_tokens=4096,
            host_ratio=2.0,
            storage_url="memory://?capacity_bytes=100000000",
            prefetch_threshold=16,
        )
        run = run_configuration(config, requests, family=family, policy="lru", page_size=16)
        yield from run.collectors
    yield PoolCollector({"req": ReqToTokenPool(size=4, max_context_len=64)})


def reference_metrics(classes: Iterable[type[Collector]] | None = None) -> list[MetricDoc]:
    """Every metric the given collector classes (default: `discover_collectors()`) export,
    sorted by name. Raises UndocumentedCollector for a class no example covers."""
    wanted = set(discover_collectors() if classes is None else classes)
    wanted.discard(ConfigCollector)  # re-exports the others under a label
    examples: list[Collector] = [c for c in _member_examples() if type(c) in wanted]
    for cls in sorted(wanted - {type(c) for c in examples}, key=_path):
        make = getattr(cls, "reference_collectors", None)
        if make is None:
            raise UndocumentedCollector(
                f"{_path(cls)} is not built by the replay and has no reference_collectors() "
                "classmethod: the metrics reference cannot list its metrics"
            )
        examples.extend(make())
    docs: dict[str, MetricDoc] = {}
    for collector in examples:
        for family in collector.collect():
            name = f"{family.name}_total" if family.type == "counter" else family.name
            doc = docs.setdefault(
                name,
                MetricDoc(
                    name=name,
                    type=family.type,
                    help=family.documentation,
                    source=_path(type(collector)),
                ),
            )
            declared = getattr(family, "_labelnames", ())
            for label in declared:
                doc.label_values.setdefault(label, set())
            for sample in family.samples:
                for label, value in sample.labels.items():
                    if label not in ("le", "quantile"):
                        doc.label_values.setdefault(label, set()).add(value)
    for doc in docs.values():
        doc.labels = sorted(doc.label_values)
    return sorted(docs.values(), key=lambda d: d.name)


_HEADER = """\
# kvstrata metrics reference

Generated from the code by `uv run python -m kvstrata.replay.reference docs/metrics.md`;
`packages/kvstrata/tests/test_metrics_reference.py` fails when this file and the collectors
differ. Every collector class in a `kvstrata.*metrics` module is listed, members and Ray
services alike.

## Naming rules

- Every name starts with `kvstrata_<component>_` (`pool`, `allocator`, `host`, `storage`,
  `tier` for the tier controller, `radix`, `tiered_cache`, `replay`; services: `l3_store`,
  `prefix_index`).
- Base units, named in the metric: `_bytes`, `_seconds`, and counted things in the plural
  (`_tokens`, `_pages`, `_slots`, `_states`, `_calls`); counters end in `_total` (the collectors
  name them without it; the exposition adds it). No `_ms`, `_kb`, ratios or percentages: rates
  and shares are computed in PromQL.
- One concept, one name: bytes moved are `*_transfer_bytes_total{direction}` in every layer,
  with the same `direction` values (`d2h`, `h2d`, `storage_get`, `storage_set`); hits per tier
  are `*_hit_tokens_total{tier}` (`device`, `host`, `storage`); evictions are
  `*_evicted_<unit>_total`.
- Labels: only those in the table below, each with a bounded set of values (names the
  application gives its pools, allocators, controllers and storages; enums). Never a request,
  prefix, page key or token id.
- `instance`, `job`, `node`, `namespace` and `service` are target labels, attached by the scrape
  (ops/prometheus/prometheus.yml: `service` and the Ray `node` by relabelling); a collector must
  not set them, or Prometheus renames its label to `exported_<name>`. `kvstrata replay` adds
  `config` (the tier configuration: `device`, `device+host`, `device+host+storage`) to every
  series it serves.

## Rules for the Ray services (`kvstrata_l3_store_*`, `kvstrata_prefix_index_*`)

- Each service's collector lives in a module whose name ends in `metrics` (e.g.
  `kvstrata.l3_store.metrics`) and subclasses `prometheus_client.registry.Collector`, reading
  plain counters at scrape time; nothing registers at import.
- The collector class defines a `reference_collectors()` classmethod returning small live
  collectors (built without Ray), so this reference lists its metrics; without it the test fails.
- Each actor serves its own registry with `prometheus_client.start_http_server(port,
  addr=...)` on its node (9401: L3 store, 9402: prefix index; ops/prometheus/prometheus.yml
  finds the nodes through Ray's service-discovery file), not `ray.util.metrics`, which prefixes
  `ray_`, needs `ray[default]` and reports ~10 s late.
- Expected names (dashboard panels wait for them): `kvstrata_l3_store_used_bytes`,
  `kvstrata_l3_store_capacity_bytes`, `kvstrata_l3_store_pages`,
  `kvstrata_l3_store_transfer_bytes_total{direction}` (`storage_get`, `storage_set`),
  `kvstrata_l3_store_operation_seconds{operation}` (histogram),
  `kvstrata_prefix_index_entries`, `kvstrata_prefix_index_lookups_total`,
  `kvstrata_prefix_index_lookup_seconds` (histogram), `kvstrata_prefix_index_events_total{kind}`.
"""


def render(docs: Iterable[MetricDoc] | None = None) -> str:
    """The reference as Markdown."""
    rows = list(reference_metrics() if docs is None else docs)
    used = sorted({label for d in rows for label in d.labels})
    out = [_HEADER, "\n## Labels\n\n| label | values |\n|---|---|\n"]
    out += [f"| `{label}` | {ALLOWED_LABELS.get(label, '**not allowed**')} |\n" for label in used]
    by_source: dict[str, list[MetricDoc]] = {}
    for doc in rows:
        by_source.setdefault(doc.source, []).append(doc)
    for source in sorted(by_source):
        out.append(f"\n## `{source}`\n\n| metric | type | labels | help |\n|---|---|---|---|\n")
        for d in by_source[source]:
            labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
            text = d.help.replace("|", "\\|")
            out.append(f"| `{d.name}` | {d.type} | {labels} | {text} |\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    """`python -m kvstrata.replay.reference [FILE]`: print the reference, or write FILE."""
    text = render()
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
