"""The reference engine (`kvstrata.testkit.reference_engine`): for MHA (GQA), MLA, SWA-hybrid
and Mamba-hybrid models, every request's logits at every output step are bitwise identical
with the prefix cache on and off, on a memory system tight enough that requests are retracted
and cached prefixes evicted (both asserted to happen)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.testkit.reference_engine import EngineRun, ReferenceEngine, ReferenceModel
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
