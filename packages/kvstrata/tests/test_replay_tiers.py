"""`kvstrata replay` with a host tier and storage: per-tier hits, verified KV, the CLI options."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstrata.build import (
    InvalidCapacity,
    MemorySystem,
    TieredSystem,
    TiersUnsupported,
    build_memory_system,
)
from kvstrata.build import tiers as tiers_module
from kvstrata.build.tiers import build_tiers
from kvstrata.cli.main import main
from kvstrata.cli.replay_command import JSON_KEYS, TIER_JSON_KEYS
from kvstrata.hybrid_cache import PrefetchPolicy, TierController
from kvstrata.pool import SWAKVPool
from kvstrata.pool_host import HostLayout
from kvstrata.replay import (
    ReplayCollector,
    ReplayEngine,
    ReplayRequest,
    ReplayStats,
    TierStats,
    WorkloadSpec,
    generate_workload,
)
from kvstrata.storage import MemoryStorage
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _verified_replay(
    system: MemorySystem, tiers: TieredSystem, requests: list[ReplayRequest]
) -> tuple[ReplayEngine, ReplayStats, TierStats]:
    """Replay `requests` with `verify` (every hit read back against the KV written for its
    tokens), drain, check both tiers' integrity and close them. The stats are read after the
    drain: host writes go out in batches, so the last ones finish after the run returns. The
    hits of the three tiers add up to the run's hits."""
    try:
        engine = ReplayEngine(system, verify=True, tiers=tiers)
        engine.run(requests)
        tiers.cache.drain()
        stats = engine.stats()
        tiers.check_integrity()
    finally:
        tiers.close()
    t = stats.tiers
    assert t is not None
    assert t.device_hit_tokens + t.host_hit_tokens + t.storage_hit_tokens == stats.hit_tokens
    return engine, stats, t


def _replay_json(tmp_path: Path, *options: str) -> dict[str, Any]:
    """`kvstrata replay *options --json`: exit 0, every tier key in the record and the hits of
    the three tiers adding up to the run's hits; the record."""
    out = tmp_path / "replay.json"
    assert main(["replay", *options, "--json", str(out), "--no-progress"]) == 0
    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    assert sorted(record) == sorted((*JSON_KEYS, *TIER_JSON_KEYS))
    tiers = record["device_hit_tokens"] + record["host_hit_tokens"] + record["storage_hit_tokens"]
    assert tiers == record["hit_tokens"]
    return record


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_tiered_replay_verifies_every_hit(policy: WritePolicy) -> None:
    """A device too small for the workload: hits come back from the host and storage, and
    `verify` reads every one back against the KV written for its tokens."""
    requests = generate_workload(WorkloadSpec(seed=1))[:48]
    system = build_memory_system(family="mha", capacity_tokens=4096, page_size=16)
    params = TierParams(
        write_policy=policy, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=16
    )
    tiers = build_tiers(
        system, host_tokens=8192, storage_url="memory://?capacity_bytes=100000000", params=params
    )
    engine, stats, t = _verified_replay(system, tiers, requests)
    assert stats.evicted_tokens > 0 and t.host_hit_tokens > 0
    assert t.bytes_d2h > 0 and t.bytes_h2d > 0 and t.failed_transfers == 0
    registry = CollectorRegistry()
    registry.register(ReplayCollector(engine))
    by_tier = [
        registry.get_sample_value("kvstrata_replay_hit_tokens_total", {"tier": tier})
        for tier in ("device", "host", "storage")
    ]
    assert by_tier == [t.device_hit_tokens, t.host_hit_tokens, t.storage_hit_tokens]
    device_only = build_memory_system(family="mha", capacity_tokens=4096, page_size=16)
    plain = ReplayEngine(device_only).run(requests)
    assert stats.hit_tokens > plain.hit_tokens, "the lower tiers must add hits"


def test_build_tiers_refuses_before_allocating() -> None:
    mha = build_memory_system(family="mha", capacity_tokens=1024, page_size=16)
    with pytest.raises(InvalidCapacity):
        build_tiers(mha, host_tokens=1024, host_ratio=2.0)
    with pytest.raises(InvalidCapacity):
        build_tiers(mha, host_ratio=-1.0)
    with pytest.raises(TiersUnsupported, match="storage_url and storage"):
        build_tiers(mha, storage_url="memory://", storage=MemoryStorage(capacity_bytes=1 << 20))
    assert mha.tree.host_tier is None


def test_build_tiers_takes_an_opened_storage_and_sizes_mirrors_in_whole_slots() -> None:
    """An opened storage object becomes the L3 tier as given; `host_tokens` sizes the other
    mirrors in exact proportion (11 state slots x 15/11 = 15, which a float ratio rounds to
    14) and `host_layout` is the mirrors' layout."""
    mamba = build_memory_system(
        family="mamba", capacity_tokens=11 * 16, page_size=16, mamba_slots=11
    )
    storage = MemoryStorage(capacity_bytes=1 << 22)
    tiers = build_tiers(
        mamba, host_tokens=15 * 16, storage=storage, host_layout=HostLayout.layer_first
    )
    try:
        assert tiers.storage is storage and tiers.controller.storage is storage
        assert tiers.host_tokens == 15 * 16 and tiers.host_state_slots == 15
        assert {h.layout for h in tiers.host_pools.values()} == {HostLayout.layer_first}
    finally:
        tiers.close()


@pytest.mark.parametrize("family", ["mamba", "swa"])
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_tiered_hybrid_replay_verifies_every_hit(family: str, policy: WritePolicy) -> None:
    """Mamba and SWA models over a device too small for the workload: the host brings hits
    back, `verify` reads every one back (KV, the Mamba state at the hit's end, the SWA window),
    and the bytes moved include the states / window pages beside the full pages."""
    requests = generate_workload(WorkloadSpec(seed=1))[:48]
    system = build_memory_system(family=family, capacity_tokens=4096, page_size=16)
    tiers = build_tiers(system, host_ratio=2.0, params=TierParams(write_policy=policy))
    _, stats, t = _verified_replay(system, tiers, requests)
    assert t.failed_transfers == 0 and t.storage_hit_tokens == 0
    counters = tiers.cache.counters
    full_bytes = tiers.host_pool.bytes_per_token
    other = "mamba" if family == "mamba" else "swa"
    assert set(tiers.host_pools) == {"full", other}
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE and family == "mamba":
        # Each prefix of this workload is matched at most once on the device before the small
        # device evicts it, so nothing is hit a second time and nothing is written.
        assert t.bytes_d2h == 0
        return
    assert t.host_hit_tokens > 0 and stats.evicted_tokens > 0
    # The full pages alone would be exactly tokens x bytes per token: the rest is states or
    # SWA window pages moved with them.
    assert t.bytes_d2h > counters.written_tokens * full_bytes > 0
    assert t.bytes_h2d > counters.loaded_tokens * full_bytes > 0
    if policy is WritePolicy.WRITE_BACK:
        # Deterministic only here: under write_through a write in flight pins its device
        # nodes, so which node an eviction takes (and the hit total) depends on ack timing.
        plain = ReplayEngine(
            build_memory_system(family=family, capacity_tokens=4096, page_size=16)
        ).run(requests)
        assert stats.hit_tokens > plain.hit_tokens, "the host tier must add hits"


def test_tiered_swa_replay_with_storage() -> None:
    """SWA + storage (the hierarchical cache's SWA storage): the replay verifies every hit and
    backs pages up. (A refusal by the cache is tested with a stand-in below.)"""
    requests = generate_workload(WorkloadSpec(seed=1))[:32]
    system = build_memory_system(family="swa", capacity_tokens=4096, page_size=16)
    params = TierParams(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=16)
    tiers = build_tiers(
        system, host_ratio=1.0, storage_url="memory://?capacity_bytes=100000000", params=params
    )
    _, _, t = _verified_replay(system, tiers, requests)
    assert t.failed_transfers == 0
    assert t.bytes_storage_set > 0


def test_build_tiers_sizes_every_mirror_by_one_rule() -> None:
    mamba = build_memory_system(family="mamba", capacity_tokens=4096, page_size=16)
    state_slots = mamba.mamba_allocator.size if mamba.mamba_allocator else 0
    tiers = build_tiers(mamba, host_tokens=8192)
    try:
        assert tiers.host_tokens == 8192 and tiers.host_swa_tokens is None
        assert tiers.host_state_slots == 2 * state_slots
    finally:
        tiers.close()
    swa = build_memory_system(family="swa", capacity_tokens=4096, page_size=16, swa_ratio=0.5)
    kv = swa.kv_pool
    assert isinstance(kv, SWAKVPool)
    device_bytes = sum(
        b.numel() * b.element_size()
        for pool in (kv.full_pool, kv.swa_pool)
        for b in pool.layer_buffers()
    )
    tiers = build_tiers(swa, host_bytes=device_bytes)
    try:
        assert tiers.host_state_slots is None
        # One device's worth of bytes (the device buffers count their padding page too),
        # split like the device: each mirror about as large as its pool.
        assert tiers.host_swa_tokens is not None
        assert tiers.host_tokens == pytest.approx(4096, rel=0.02)
        assert tiers.host_swa_tokens == pytest.approx(2048, rel=0.02)
        total = sum(h.size_bytes for h in tiers.host_pools.values())
        assert total <= device_bytes
    finally:
        tiers.close()


def test_build_tiers_reports_a_refused_combination(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the hierarchical cache refuses a combination (as it refused storage under an SWA
    tree until that was wired), build_tiers says so with TiersUnsupported, stops the
    controller it started and leaves the tree without a host tier."""
    started: list[TierController] = []

    def controller(*args: object, **kwargs: object) -> TierController:
        made = TierController(*args, **kwargs)  # type: ignore[arg-type]
        started.append(made)
        return made

    def refuse(*args: object, **kwargs: object) -> HierarchicalCache:
        raise InvalidConfig("storage (L3) for SWA trees is not wired")

    monkeypatch.setattr(tiers_module, "TierController", controller)
    monkeypatch.setattr(tiers_module, "HierarchicalCache", refuse)
    swa = build_memory_system(family="swa", capacity_tokens=1024, page_size=16)
    with pytest.raises(TiersUnsupported, match=r"swa family.*storage.*not wired"):
        build_tiers(swa, host_ratio=2.0, storage_url="memory://?capacity_bytes=1000000")
    assert len(started) == 1 and started[0].closed
    assert swa.tree.host_tier is None


def test_cli_reports_hits_per_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = _replay_json(
        tmp_path,
        "--limit", "40",
        "--capacity-tokens", "4096",
        "--host-ratio", "2",
        "--storage", "memory://?capacity_bytes=100000000",
        "--write-policy", "write_back",
        "--prefetch-policy", "wait_complete",
        "--prefetch-threshold", "16",
    )  # fmt: skip
    assert record["host_tokens"] == 8192 and record["write_policy"] == "write_back"
    assert record["hit_tokens"] > 0
    assert record["bytes_d2h"] > 0
    text = capsys.readouterr().out
    for row in ("hits: device", "hits: host", "hits: storage", "waited for transfers"):
        assert row in text


@pytest.mark.parametrize(
    ("family", "size"), [("mamba", ["--host-ratio", "2"]), ("swa", ["--host-bytes", "400000"])]
)
def test_cli_hybrid_families_with_a_host_tier(
    family: str, size: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _replay_json(
        tmp_path,
        "--family", family,
        "--limit", "80",
        "--capacity-tokens", "4096",
        *size,
        "--verify",
    )  # fmt: skip
    assert record["host_hit_tokens"] > 0
    assert record["bytes_d2h"] > 0 and record["bytes_h2d"] > 0
    text = capsys.readouterr().out
    if family == "mamba":
        assert record["host_state_slots"] > 0 and record["host_swa_tokens"] is None
        assert "state slots" in text
    else:
        assert record["host_swa_tokens"] > 0 and record["host_state_slots"] is None
        assert "SWA tokens" in text


def test_cli_mamba_with_storage(tmp_path: Path) -> None:
    record = _replay_json(
        tmp_path,
        "--family", "mamba",
        "--limit", "40",
        "--capacity-tokens", "4096",
        "--storage", "memory://?capacity_bytes=100000000",
        "--prefetch-threshold", "16",
        "--verify",
    )  # fmt: skip
    assert record["bytes_storage_set"] > 0 and record["failed_transfers"] == 0


def test_cli_refused_tiers_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: object, **kwargs: object) -> HierarchicalCache:
        raise InvalidConfig("storage (L3) for SWA trees is not wired")

    monkeypatch.setattr(tiers_module, "HierarchicalCache", refuse)
    argv = [
        "replay", "--limit", "4", "--family", "swa", "--host-ratio", "2",
        "--storage", "memory://?capacity_bytes=1000000", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "swa family" in err and "storage" in err


def test_cli_bad_host_size_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--limit", "4", "--family", "mamba", "--host-ratio", "0", "--no-progress"]
    assert main(argv) == 2
    assert "host size must be positive" in capsys.readouterr().err


def test_mamba_chunk_state_reaches_the_host() -> None:
    """A prompt of whole pages may reuse only N - P tokens on a repeat, where the chunk
    boundary state lies; the engine hands that chunk to the write policy, so after the device
    lost everything the repeat's host hit ends there (N - P), state verified."""
    system = build_memory_system(family="mamba", capacity_tokens=1024, page_size=16)
    tiers = build_tiers(system, host_ratio=2.0)
    try:
        engine = ReplayEngine(system, verify=True, tiers=tiers)
        prompt = ReplayRequest(token_ids=np.arange(1, 65, dtype=np.int64))
        assert engine.step(prompt).hit_tokens == 0
        tiers.cache.drain()
        assert tiers.cache.evict_device(10_000) == 64
        assert engine.step(prompt).hit_tokens == 48
        t = engine.stats().tiers
        assert t is not None and t.host_hit_tokens == 48 and t.device_hit_tokens == 0
        tiers.cache.drain()
        tiers.check_integrity()
    finally:
        tiers.close()
