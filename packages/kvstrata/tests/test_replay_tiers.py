"""`kvstrata replay` with a host tier and storage: per-tier hits, verified KV, the CLI options."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstrata.build import InvalidCapacity, InvalidModel, build_memory_system
from kvstrata.build.tiers import build_tiers
from kvstrata.cli.main import main
from kvstrata.cli.replay_command import JSON_KEYS, TIER_JSON_KEYS
from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.replay import ReplayCollector, ReplayEngine, WorkloadSpec, generate_workload
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


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
    try:
        engine = ReplayEngine(system, verify=True, tiers=tiers)
        stats = engine.run(requests)
        tiers.cache.drain()
        tiers.check_integrity()
    finally:
        tiers.close()
    t = stats.tiers
    assert t is not None
    assert t.device_hit_tokens + t.host_hit_tokens + t.storage_hit_tokens == stats.hit_tokens
    assert stats.evicted_tokens > 0 and t.host_hit_tokens > 0
    assert t.bytes_d2h > 0 and t.bytes_h2d > 0 and t.failed_transfers == 0
    registry = CollectorRegistry()
    registry.register(ReplayCollector(engine))
    by_tier = [
        registry.get_sample_value("kvstrata_replay_tier_hit_tokens_total", {"tier": tier})
        for tier in ("device", "host", "storage")
    ]
    assert by_tier == [t.device_hit_tokens, t.host_hit_tokens, t.storage_hit_tokens]
    device_only = build_memory_system(family="mha", capacity_tokens=4096, page_size=16)
    plain = ReplayEngine(device_only).run(requests)
    assert stats.hit_tokens > plain.hit_tokens, "the lower tiers must add hits"


def test_build_tiers_refuses_before_allocating() -> None:
    swa = build_memory_system(family="swa", capacity_tokens=1024, page_size=16)
    with pytest.raises(InvalidModel):
        build_tiers(swa, host_tokens=1024)
    mha = build_memory_system(family="mha", capacity_tokens=1024, page_size=16)
    with pytest.raises(InvalidCapacity):
        build_tiers(mha, host_tokens=1024, host_ratio=2.0)
    with pytest.raises(InvalidCapacity):
        build_tiers(mha, host_ratio=-1.0)


def test_cli_reports_hits_per_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiers.json"
    argv = [
        "replay",
        "--limit", "40",
        "--capacity-tokens", "4096",
        "--host-ratio", "2",
        "--storage", "memory://?capacity_bytes=100000000",
        "--write-policy", "write_back",
        "--prefetch-policy", "wait_complete",
        "--prefetch-threshold", "16",
        "--json", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text(encoding="utf-8"))
    assert sorted(record) == sorted((*JSON_KEYS, *TIER_JSON_KEYS))
    assert record["host_tokens"] == 8192 and record["write_policy"] == "write_back"
    tiers = record["device_hit_tokens"] + record["host_hit_tokens"] + record["storage_hit_tokens"]
    assert tiers == record["hit_tokens"] > 0
    assert record["bytes_d2h"] > 0
    text = capsys.readouterr().out
    for row in ("hits: device", "hits: host", "hits: storage", "waited for transfers"):
        assert row in text


def test_cli_tier_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--limit", "4", "--family", "swa", "--host-ratio", "2", "--no-progress"]
    assert main(argv) == 2
    assert "mha" in capsys.readouterr().err
