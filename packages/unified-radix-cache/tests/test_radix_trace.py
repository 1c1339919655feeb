"""Replaying the shared Mooncake trace reproduces its known hit rates (traces/README.md):
36.64 % of blocks unbounded, and leaf-first LRU 4.45 / 21.16 / 36.37 % at 1,000 / 10,000 /
100,000 blocks, within 0.3 points. T = P = 16, so token and block hit rates coincide."""

from __future__ import annotations

import json
from array import array

import pytest

from kvstrata.testkit import WORKSPACE_ROOT
from kvstrata.testkit.trees import lru_prefix_hits

TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
T = P = 16


@pytest.fixture(scope="module")
def keys() -> list[array]:
    if not TRACE.is_file():
        pytest.skip(f"shared trace not found at {TRACE} (the workspace's ../shared is absent)")
    with TRACE.open() as fh:
        return [
            array("q", [h * T + j for h in json.loads(line)["hash_ids"] for j in range(T)])
            for line in fh
        ]


def _replay(keys: list[array], capacity_blocks: int) -> float:
    """Token hit rate (%) of the LRU tree at `capacity_blocks` (0: unbounded)."""
    hit = lru_prefix_hits(keys, page_size=P, capacity_tokens=capacity_blocks * T or None)
    return 100.0 * hit / sum(len(tokens) for tokens in keys)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("capacity_blocks", "expected"), [(0, 36.64), (1_000, 4.45), (10_000, 21.16), (100_000, 36.37)]
)
def test_trace_hit_rates(keys: list[array], capacity_blocks: int, expected: float) -> None:
    assert abs(_replay(keys, capacity_blocks) - expected) < 0.3
