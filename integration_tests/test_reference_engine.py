"""The reference engine (`kvstrata.replay.reference_engine`): for MHA (GQA), MLA, SWA-hybrid
and Mamba-hybrid models, every request's logits at every output step are bitwise identical
with the prefix cache on and off, on a memory system tight enough that requests are retracted
and cached prefixes evicted (both asserted to happen)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.build import BuildOptions, ModelMemorySpec, SizingParams, build_tiered
from kvstrata.hybrid_cache import PrefetchPolicy
from kvstrata.replay.reference_engine import EngineRun, ReferenceEngine, ReferenceModel
from kvstrata.testkit.tiny_models import TINY_MODELS, tiny_system
from kvstrata.unified_radix_cache import TierCounters
from kvstrata.unified_radix_cache.tiers import TierParams

SHARED = [list(range(1, 14)), list(range(20, 29))]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(8):
        tail = torch.randint(30, 60, (3 + i % 5,), generator=gen).tolist()
        out.append([*SHARED[i % 2], *tail])
    return out


def _run(kind: str, *, cache_prefixes: bool, kv_tokens: int) -> tuple[EngineRun, int]:
    system = tiny_system(kind, kv_tokens=kv_tokens, context_len=32, mamba_slots=12)
    model = ReferenceModel(TINY_MODELS[kind], system, seed=3)
    engine = ReferenceEngine(
        model, system.cache, chunk=6, max_running=4, cache_prefixes=cache_prefixes
    )
    run = engine.run(_prompts(), max_new_tokens=5)
    system.check_integrity()
    return run, system.cache.evicted_tokens


@pytest.mark.parametrize("kind", ["mha", "mla", "swa", "mamba", "falcon_h1"])
def test_logits_are_bitwise_identical_with_the_cache_on_and_off(kind: str) -> None:
    on, evicted = _run(kind, cache_prefixes=True, kv_tokens=40)
    off, _ = _run(kind, cache_prefixes=False, kv_tokens=400)
    assert on.hit_tokens > 0 and off.hit_tokens == 0
    assert on.retractions > 0 and evicted > 0
    assert off.retractions == 0
    assert on.outputs == off.outputs
    for rid, steps in off.logits.items():
        assert len(on.logits[rid]) == len(steps) == 5
        for a, b in zip(on.logits[rid], steps, strict=True):
            assert torch.equal(a, b), f"request {rid}: logits differ"


def _tiered_run(
    kind: str, *, host_ratio: float, storage: bool, chunk: int = 6
) -> tuple[EngineRun, TierCounters]:
    spec = ModelMemorySpec.from_hf_config(TINY_MODELS[kind])
    mamba = bool(spec.mamba_layer_ids)
    sizing = SizingParams(
        page_size=4,
        context_len=32,
        max_running_requests=8,
        host_ratio=host_ratio,
        mamba_cache_size=12 if mamba else None,
    )
    states = 12 * spec.state_bytes_per_request if mamba else 0
    budget = 9 * 32 * 4 + states + 40 * spec.kv_bytes_per_token
    options = BuildOptions(
        sizing=sizing,
        storage_url="memory://?capacity_bytes=10000000" if storage else None,
        # Storage hits are fetched back however short (the default waits for 256 tokens).
        tier_params=TierParams(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=4),
    )
    tiers = build_tiered(spec, budget, options)
    try:
        model = ReferenceModel(TINY_MODELS[kind], tiers.system, seed=3)
        engine = ReferenceEngine(model, tiers.cache, chunk=chunk, max_running=4)
        on = engine.run(_prompts() * 2, max_new_tokens=5)
    finally:
        tiers.close()
    tiers.check_integrity()
    counters = tiers.cache.transfer_counters()
    assert counters is not None
    return on, counters


def _assert_same_logits(on: EngineRun, kind: str, repeats: int = 1) -> None:
    off, _ = _run(kind, cache_prefixes=False, kv_tokens=400)
    n = len(off.logits)
    for rid in range(n * repeats):
        steps = off.logits[rid % n]
        assert on.outputs[rid] == off.outputs[rid % n]
        for a, b in zip(on.logits[rid], steps, strict=True):
            assert torch.equal(a, b), f"request {rid}: logits differ"


@pytest.mark.parametrize("kind", ["mha", "mla", "mamba", "falcon_h1"])
def test_logits_are_identical_after_pages_went_to_host_and_back(kind: str) -> None:
    on, counters = _tiered_run(kind, host_ratio=3.0, storage=False)
    assert counters.bytes_h2d > 0  # hits loaded back from the host
    assert on.retractions > 0
    _assert_same_logits(on, kind, repeats=2)


# Mamba-hybrids prefill in page-sized chunks here: the cache prefetches a Mamba prefix from
# storage only up to a stored state, and a state is cached where a chunk ends on a page.
@pytest.mark.parametrize(
    ("kind", "chunk"), [("mha", 6), ("mla", 6), ("swa", 6), ("mamba", 4), ("falcon_h1", 4)]
)
def test_logits_are_identical_after_pages_went_to_storage_and_back(kind: str, chunk: int) -> None:
    # A host tier the size of the device: what it drops was backed up to storage, and the
    # second pass over the prompts finds part of its prefixes only there.
    on, counters = _tiered_run(kind, host_ratio=1.0, storage=True, chunk=chunk)
    assert counters.bytes_storage_set > 0 and counters.bytes_storage_get > 0
    assert counters.bytes_h2d > 0
    assert on.retractions > 0
    _assert_same_logits(on, kind, repeats=2)


# SWA-hybrid with a host tier: a chunk's insert over a prefix page whose SWA slots were
# evicted while another running request held its full slots used to leave the inserting
# request without SWA slots for its window (fixed in unified-radix-cache 0.3.0).
def test_swa_logits_after_pages_went_to_host_and_back() -> None:
    on, counters = _tiered_run("swa", host_ratio=3.0, storage=False)
    assert counters.bytes_h2d > 0
    _assert_same_logits(on, "swa", repeats=2)
