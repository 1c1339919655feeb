"""`kvstrata services`: argument parsing and the status table (the Ray side is tested in
services/l3-store/tests)."""

from __future__ import annotations

import pytest

from kvstrata.cli.main import build_parser
from kvstrata.cli.services_command import _check_up, _run, _table
from kvstrata.l3_store.core import CoreStats
from kvstrata.l3_store.deploy import StoreStatus


def _stats(**kw: int) -> CoreStats:
    base = dict.fromkeys(CoreStats.__dataclass_fields__, 0)
    return CoreStats(**{**base, **kw})


def test_up_parses_sizes_and_defaults() -> None:
    args = build_parser().parse_args(
        ["services", "up", "--store-bytes", "2GiB", "--disk", "/d", "--disk-bytes", "1_000"]
    )
    assert (args.action, args.store_bytes, args.disk, args.disk_bytes) == (
        "up",
        2 << 30,
        "/d",
        1000,
    )
    assert (args.address, args.namespace, args.metrics_addr) == ("auto", "kvstrata", "127.0.0.1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["services", "up", "--store-bytes", "lots"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["services", "restart"])


def test_status_table_rows() -> None:
    before = [StoreStatus("a" * 56, _stats(operations=10)), StoreStatus("b" * 56, None)]
    after = [
        StoreStatus(
            "a" * 56,
            _stats(
                operations=30,
                hits_memory=3,
                hits_disk=1,
                misses=4,
                memory_pages=5,
                disk_pages=2,
                memory_used_bytes=1 << 30,
                memory_capacity_bytes=4 << 30,
            ),
        ),
        StoreStatus("b" * 56, None),
    ]
    lines = _table(before, after, 2.0).splitlines()
    assert lines[0].split() == ["node", "mem", "GiB", "mem", "cap", "disk", "GiB", "pages",
                                "hit", "rate", "ops/s"]  # fmt: skip
    assert lines[1].split() == ["a" * 12, "1.00", "4.00", "0.00", "7", "50.0%", "10.0"]
    assert lines[2].split() == ["b" * 12, "down"]


def test_up_deploys_the_index_too_and_checks_its_flags_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["services", "up"])
    assert (args.index_page_size, args.index_metrics_port, _check_up(args)) == (16, 0, "")
    ops = build_parser().parse_args(
        ["services", "up", "--metrics-port", "9401", "--index-metrics-port", "9402"]
    )
    assert (ops.metrics_port, ops.index_metrics_port, _check_up(ops)) == (9401, 9402, "")
    for argv, problem in (
        (["--index-page-size", "-1"], "--index-page-size must be >= 0, got -1"),
        (["--index-metrics-port", "70000"], "--index-metrics-port must be in 0..65535, got 70000"),
        (["--metrics-port", "-2"], "--metrics-port must be in 0..65535, got -2"),
    ):
        bad = build_parser().parse_args(["services", "up", *argv])
        assert _check_up(bad) == problem
        # Refused before joining a cluster (there is none here): exit 2 with the message.
        assert _run(bad) == 2
        assert problem in capsys.readouterr().err
