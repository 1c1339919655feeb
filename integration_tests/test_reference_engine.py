"""The reference engine (`kvstrata.replay.reference_engine`): for MHA (GQA), MLA, SWA-hybrid
and Mamba-hybrid models, every request's logits at every output step are bitwise identical
with the prefix cache on and off, on a memory system tight enough that requests are retracted
and cached prefixes evicted (both asserted to happen)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.build import BuildOptions, ModelMemorySpec, SizingParams, build_tiered
from kvstrata.replay.reference_engine import EngineRun, ReferenceEngine, ReferenceModel
from kvstrata.testkit.tiny_models import TINY_MODELS, tiny_system

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


@pytest.mark.parametrize("kind", ["mha", "mla", "swa", "mamba"])
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


@pytest.mark.parametrize("kind", ["mha", "mamba"])
def test_logits_are_identical_after_pages_went_to_host_and_back(kind: str) -> None:
    spec = ModelMemorySpec.from_hf_config(TINY_MODELS[kind])
    mamba = bool(spec.mamba_layer_ids)
    sizing = SizingParams(
        page_size=4,
        context_len=32,
        max_running_requests=8,
        host_ratio=3.0,
        mamba_cache_size=12 if mamba else None,
    )
    states = 12 * spec.state_bytes_per_request if mamba else 0
    budget = 9 * 32 * 4 + states + 40 * spec.full_kv_bytes_per_token
    options = BuildOptions(sizing=sizing, storage_url="memory://?capacity_bytes=10000000")
    tiers = build_tiered(spec, budget, options)
    try:
        model = ReferenceModel(TINY_MODELS[kind], tiers.system, seed=3)
        engine = ReferenceEngine(model, tiers.cache, chunk=6, max_running=4)
        on = engine.run(_prompts(), max_new_tokens=5)
    finally:
        tiers.close()
    counters = tiers.cache.transfer_counters()
    assert counters is not None and counters.bytes_h2d > 0  # hits loaded back from the host
    assert on.retractions > 0
    off, _ = _run(kind, cache_prefixes=False, kv_tokens=400)
    assert on.outputs == off.outputs
    for rid, steps in off.logits.items():
        for a, b in zip(on.logits[rid], steps, strict=True):
            assert torch.equal(a, b), f"request {rid}: logits differ"
