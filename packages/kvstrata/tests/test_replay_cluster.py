"""`kvstrata replay --instances N`: routing and accounting on small deterministic traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cli.main import main
from kvstrata.replay import ReplayOptionError, ReplayRequest
from kvstrata.replay.cluster import (
    ClusterReport,
    ClusterSpec,
    LocalCluster,
    arrival_order,
    run_cluster,
)
from kvstrata.storage import MemoryStorage


def _req(blocks: list[int], *, t_ms: int | None = None, out: int = 0) -> ReplayRequest:
    return ReplayRequest(
        token_ids=np.asarray(blocks, dtype=np.int64), output_length=out, timestamp_ms=t_ms
    )


def _spec(router: str, n: int = 2, cap: int = 100, **kw: float) -> ClusterSpec:
    return ClusterSpec(num_instances=n, capacity_pages=cap, router=router, page_size=1, **kw)  # type: ignore[arg-type]


def _accounting(report: ClusterReport) -> None:
    assert report.hits == sum(i.device_hits + i.host_hits + i.l3_hits for i in report.instances)
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
    # The engine computes at least one token: a repeated 3-page prompt reuses 2 pages.
    assert [(i.requests, i.device_hits, i.host_hits, i.l3_hits) for i in report.instances] == [
        (2, 2, 0, 0),
        (2, 2, 0, 0),
    ]
    assert report.hits == 4 and report.pages == 12
    assert report.pooled_hits == 6  # one cache: every repeat hits
    assert report.max_load_ratio == 1.0


def test_cache_aware_follows_the_prefix_and_reaches_the_pooled_figure() -> None:
    report = run_cluster(_spec("cache-aware", load_weight=0.1), [_req(b) for b in SAME])
    _accounting(report)
    assert [row[1] for row in report.timeline] == [0, 0, 0, 0]
    assert report.hits == report.pooled_hits == 6
    assert report.max_load_ratio == 2.0


PROMPT = [1, 2, 3, 4, 5, 6]


def _l3_spec(**kw: object) -> ClusterSpec:
    return ClusterSpec(
        num_instances=2,
        capacity_pages=100,
        router="round-robin",
        page_size=1,
        prefetch_threshold=1,
        **kw,  # type: ignore[arg-type]
    )


def test_shared_l3_serves_the_other_instances_pages() -> None:
    l3 = MemoryStorage(capacity_bytes=1 << 20)
    # i0 misses, i1 takes another prompt, i0 hits 5 pages on its device (write-through: a
    # page goes to the host, and on to the L3, once it is hit), i1 finds those 5 in the L3.
    reqs = [_req(PROMPT), _req([9, 9]), _req(PROMPT), _req(PROMPT)]
    report = run_cluster(_l3_spec(host_ratio=1.0), reqs, l3=l3)
    _accounting(report)
    assert [row[3] for row in report.timeline] == [0, 0, 5, 5]
    assert [(i.device_hits, i.host_hits, i.l3_hits) for i in report.instances] == [
        (5, 0, 0),
        (0, 0, 5),
    ]
    assert report.hits == report.pooled_hits == 10
    assert l3.stats().num_pages > 0
    # 1 MiB of pages of 1 token x 64 bytes (the default model: 2 layers, K and V, 4 floats).
    assert report.l3_capacity_pages == (1 << 20) // 64


def test_without_the_l3_the_other_instance_misses() -> None:
    reqs = [_req(PROMPT), _req([9, 9]), _req(PROMPT), _req(PROMPT)]
    report = run_cluster(_l3_spec(host_ratio=1.0), reqs)
    assert [row[3] for row in report.timeline] == [0, 0, 5, 0]
    assert report.l3_capacity_pages == 0


def test_a_host_tier_keeps_what_the_device_evicts() -> None:
    # One instance of 6 pages: PROMPT, then 6 other pages evict it; write-back sends the
    # evicted pages to the host, and the repeat of PROMPT finds them there.
    reqs = [_req(PROMPT), _req(list(range(20, 26))), _req(PROMPT)]
    spec = ClusterSpec(
        num_instances=1, capacity_pages=6, router="round-robin", page_size=1,
        host_ratio=4.0, write_policy="write_back", prefetch_threshold=1,
    )  # fmt: skip
    report = run_cluster(spec, reqs)
    _accounting(report)
    (inst,) = report.instances
    assert (inst.device_hits, inst.host_hits, inst.l3_hits) == (0, 5, 0)
    device_only = run_cluster(_spec("round-robin", n=1, cap=6), reqs)
    assert device_only.hits == 0


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
    # [4,5,6] went to the other instance: instance 0 still holds [1,2,3] (the repeat reuses 2
    # pages); pooled: 6 pages hold both.
    assert [row[3] for row in report.timeline] == [0, 0, 2]
    assert report.pooled_hits == 2


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_instances": 0}, "--instances"),
        ({"capacity_pages": 0}, "capacity"),
        ({"router": "random"}, "unknown router"),
        ({"page_size": 0}, "--page-size"),
        ({"decode_tps": 0.0}, "token rates"),
        ({"load_weight": -1.0}, "weights"),
        ({"host_ratio": 1.0, "host_bytes": 10}, "at most one"),
        ({"host_ratio": 0.0}, "host tier size"),
        ({"write_policy": "sometimes"}, "sometimes"),
        ({"prefetch_threshold": 0}, "prefetch_threshold"),
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


def test_a_backend_brings_its_own_l3() -> None:
    spec = _spec("round-robin")
    backend = LocalCluster(spec)
    try:
        with pytest.raises(ReplayOptionError, match="own L3"):
            run_cluster(spec, [_req([1])], l3=MemoryStorage(capacity_bytes=100), backend=backend)
        report = run_cluster(spec, [_req(b) for b in SAME], backend=backend)
        assert report.backend == "LocalCluster" and report.hits == 4
        backend.check_integrity()  # every engine's caches, and the index
        # The index holds what each instance's tree holds: the 3 pages on both.
        assert backend.index.match_lengths(backend.index.page_keys(np.array([1, 2, 3]))) == {
            "instance-0": 3,
            "instance-1": 3,
        }
    finally:
        backend.close()


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
    # 24 pages of one token x 64 bytes; with storage each instance gets a host tier (ratio 2).
    argv += ["--router", "cache-aware", "--storage", "memory://?capacity_bytes=1536"]
    assert main([*argv, "--json", str(out_json), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "pooled ideal" in text and "instance-2" in text
    doc = json.loads(out_json.read_text())
    assert doc["requests"] == 12 and doc["pages"] == 36
    assert doc["l3_capacity_pages"] == 24
    assert doc["backend"] == "LocalCluster"
    assert doc["hit_pages"] == sum(
        r["device_hit_pages"] + r["host_hit_pages"] + r["l3_hit_pages"] for r in doc["per_instance"]
    )
    assert doc["hit_pages"] > 0
    assert sum(r["requests"] for r in doc["per_instance"]) == 12
    assert abs(sum(r["load_share"] for r in doc["per_instance"]) - 1.0) < 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([], "needs --capacity-tokens"),
        (["--capacity-tokens", "8", "--unbounded"], "--unbounded"),
        (["--capacity-tokens", "8", "--family", "swa"], "--family"),
        (["--capacity-tokens", "8", "--host-ratio", "-1"], "host tier size"),
        (["--capacity-tokens", "8", "--storage", "ray://127.0.0.1:1/x"], "needs --ray"),
        (["--capacity-tokens", "8", "--ray", "--storage", "memory://"], "give --storage ray://"),
        (["--capacity-tokens", "8", "--address", "auto"], "--address needs --ray"),
        (["--capacity-tokens", "8", "--l3-bytes", "100"], "--l3-bytes sizes"),
        (["--capacity-tokens", "8", "--ray", "--storage", "ray://", "--l3-bytes", "0"], "> 0"),
        (["--capacity-tokens", "2", "--ray"], "does not fit"),
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


def test_build_tiers_shares_an_open_store() -> None:
    from kvstrata.build import TiersUnsupported, build_memory_system
    from kvstrata.build.tiers import build_tiers

    store = MemoryStorage(capacity_bytes=1 << 20)
    system = build_memory_system(family="mha", capacity_tokens=64, page_size=1)
    with pytest.raises(TiersUnsupported, match="storage_url and storage"):
        build_tiers(system, storage_url="memory://", storage=store)
    assert system.tree.host_tier is None  # refused before the tree was touched
    tiers = [
        build_tiers(
            build_memory_system(family="mha", capacity_tokens=64, page_size=1), storage=store
        )
        for _ in range(2)
    ]
    assert tiers[0].storage is tiers[1].storage is store
    for t in tiers:
        t.close()
    store.batch_set([b"k"], [b"v"])  # closing the tiers left the shared store open
    assert store.batch_exists([b"k"]) == 1
