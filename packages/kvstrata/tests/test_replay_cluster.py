"""`kvstrata replay --instances N`: routing and accounting on small deterministic traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cli.main import main
from kvstrata.replay import ReplayOptionError, ReplayRequest
from kvstrata.replay.cluster import ClusterReport, ClusterSpec, arrival_order, run_cluster
from kvstrata.storage import MemoryStorage


def _req(blocks: list[int], *, t_ms: int | None = None, out: int = 0) -> ReplayRequest:
    return ReplayRequest(
        token_ids=np.asarray(blocks, dtype=np.int64), output_length=out, timestamp_ms=t_ms
    )


def _spec(router: str, n: int = 2, cap: int = 100, **kw: float) -> ClusterSpec:
    return ClusterSpec(num_instances=n, capacity_pages=cap, router=router, **kw)  # type: ignore[arg-type]


def _accounting(report: ClusterReport) -> None:
    assert report.hits == sum(i.device_hits + i.l3_hits for i in report.instances)
    assert report.pages == sum(i.pages for i in report.instances)
    assert report.requests == sum(i.requests for i in report.instances) == len(report.timeline)
    assert sum(row[3] for row in report.timeline) == report.hits
    for k, inst in enumerate(report.instances):
        assert inst.requests == sum(1 for row in report.timeline if row[1] == k)


SAME = [[1, 2, 3]] * 4


def test_round_robin_alternates_and_hits_only_its_own_cache() -> None:
    report = run_cluster(_spec("round-robin"), [_req(b) for b in SAME])
    _accounting(report)
    assert [row[1] for row in report.timeline] == [0, 1, 0, 1]
    assert [(i.requests, i.device_hits, i.l3_hits) for i in report.instances] == [
        (2, 3, 0),
        (2, 3, 0),
    ]
    assert report.hits == 6 and report.pages == 12
    assert report.pooled_hits == 9  # one cache: every repeat hits
    assert report.max_load_ratio == 1.0


def test_cache_aware_follows_the_prefix_and_reaches_the_pooled_figure() -> None:
    report = run_cluster(_spec("cache-aware", load_weight=0.1), [_req(b) for b in SAME])
    _accounting(report)
    assert [row[1] for row in report.timeline] == [0, 0, 0, 0]
    assert report.hits == report.pooled_hits == 9
    assert report.max_load_ratio == 2.0


def test_shared_l3_serves_the_other_instances_pages() -> None:
    l3 = MemoryStorage(capacity_bytes=1000)
    report = run_cluster(_spec("round-robin"), [_req(b) for b in SAME], l3=l3)
    _accounting(report)
    # r0 on i0 misses; r1 on i1 finds all 3 pages in the L3; r2, r3 hit their devices.
    assert [row[3] for row in report.timeline] == [0, 3, 3, 3]
    assert [(i.device_hits, i.l3_hits) for i in report.instances] == [(3, 0), (3, 3)]
    assert report.hits == report.pooled_hits == 9
    assert report.l3_capacity_pages == 1000
    assert l3.stats().num_pages == 3


def test_l3_hit_continues_after_the_device_hit_only() -> None:
    l3 = MemoryStorage(capacity_bytes=1000)
    # i0: [1,2]; i1: [1,2,3,4] (L3 has 1,2); i0: [1,2,3,4,5]: device 2, L3 3,4, miss 5.
    reqs = [_req([1, 2]), _req([1, 2, 3, 4]), _req([1, 2, 3, 4, 5])]
    report = run_cluster(_spec("round-robin"), reqs, l3=l3)
    _accounting(report)
    assert [(i.device_hits, i.l3_hits) for i in report.instances] == [(2, 2), (0, 2)]


def test_load_lasts_the_prefill_plus_decode_estimate() -> None:
    # A: 10 pages at t=0, 0 s prefill (fast) + 100 tokens / 50 tps = 2 s; B: 2 pages at t=1.
    def third(t_ms: int) -> int:
        reqs = [
            _req(list(range(100, 110)), t_ms=0, out=100),
            _req([200, 201], t_ms=1000, out=1000),
            _req([300], t_ms=t_ms),
        ]
        report = run_cluster(_spec("least-loaded", prefill_tps=1e9), reqs)
        _accounting(report)
        assert [row[1] for row in report.timeline][:2] == [0, 1]
        return report.timeline[2][1]

    assert third(1500) == 1  # A (10 pages) still running: B's instance is less loaded
    assert third(2500) == 0  # A ended at 2 s: instance 0 is idle


def test_arrivals_are_ordered_by_timestamp_then_file_order() -> None:
    reqs = [_req([1], t_ms=50), _req([2], t_ms=10), _req([3], t_ms=50), _req([4], t_ms=0)]
    assert arrival_order(reqs) == [3, 1, 0, 2]
    report = run_cluster(_spec("round-robin"), reqs)
    assert [row[0] for row in report.timeline] == [0.0, 0.01, 0.05, 0.05]


def test_eviction_bounds_each_instance() -> None:
    # One instance of 3 pages: [1,2,3] then [4,5,6] evicts it all; the repeat misses.
    reqs = [_req([1, 2, 3]), _req([4, 5, 6]), _req([1, 2, 3])]
    report = run_cluster(_spec("round-robin", n=1, cap=3), reqs)
    assert report.hits == 0 and report.pooled_hits == 0
    report = run_cluster(_spec("round-robin", n=2, cap=3), reqs)
    # [4,5,6] went to the other instance: instance 0 still holds [1,2,3]; pooled: 6 pages.
    assert [row[3] for row in report.timeline] == [0, 0, 3]
    assert report.pooled_hits == 3


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_instances": 0}, "--instances"),
        ({"capacity_pages": 0}, "capacity"),
        ({"router": "random"}, "unknown router"),
        ({"page_size": 0}, "--page-size"),
        ({"decode_tps": 0.0}, "token rates"),
    ],
)
def test_spec_errors(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"num_instances": 2, "capacity_pages": 4, "router": "round-robin"}
    with pytest.raises(ReplayOptionError, match=match):
        ClusterSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_prompt_longer_than_an_instance_fails_before_any_state_changes() -> None:
    l3 = MemoryStorage(capacity_bytes=100)
    with pytest.raises(ReplayOptionError, match="does not fit"):
        run_cluster(_spec("round-robin", cap=2), [_req([1, 2]), _req([1, 2, 3])], l3=l3)
    assert l3.stats().num_pages == 0


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 100 * i, "output_length": 10, "hash_ids": [0, 1, 2 + i % 3]}
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_cli_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, png = tmp_path / "c.json", tmp_path / "c.png"
    argv = ["replay", "--trace", str(_trace(tmp_path)), "--tokens-per-block", "1"]
    argv += ["--page-size", "1", "--capacity-tokens", "8", "--instances", "3"]
    argv += ["--router", "cache-aware", "--storage", "memory://?capacity_bytes=24"]
    assert main([*argv, "--json", str(out_json), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "pooled ideal" in text and "instance-2" in text
    doc = json.loads(out_json.read_text())
    assert doc["requests"] == 12 and doc["pages"] == 36
    assert doc["l3_capacity_pages"] == 24
    assert doc["hit_pages"] == sum(
        r["device_hit_pages"] + r["l3_hit_pages"] for r in doc["per_instance"]
    )
    assert sum(r["requests"] for r in doc["per_instance"]) == 12
    assert abs(sum(r["load_share"] for r in doc["per_instance"]) - 1.0) < 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([], "needs --capacity-tokens"),
        (["--capacity-tokens", "8", "--host-ratio", "2"], "--host-ratio"),
        (["--capacity-tokens", "8", "--storage", "ray://127.0.0.1:1/x"], "needs --ray"),
        (["--capacity-tokens", "8", "--plot", "x.svg"], "PNG"),
        (["--capacity-tokens", "2"], "does not fit"),
        (["--capacity-tokens", "8", "--storage", "nope://x"], ""),
    ],
)
def test_cli_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], match: str
) -> None:
    argv = ["replay", "--trace", str(_trace(tmp_path)), "--tokens-per-block", "1"]
    argv += ["--page-size", "1", "--instances", "2", *extra]
    assert main(argv) == 2
    assert match in capsys.readouterr().err
