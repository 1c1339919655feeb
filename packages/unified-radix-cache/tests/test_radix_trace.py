"""Replaying the shared Mooncake trace reproduces its known hit rates (traces/README.md):
36.64 % of blocks unbounded, and leaf-first LRU 4.45 / 21.16 / 36.37 % at 1,000 / 10,000 /
100,000 blocks, within 0.3 points. T = P = 16, so token and block hit rates coincide."""

from __future__ import annotations

import json
from array import array

import pytest
import torch

from kvstrata.testkit import WORKSPACE_ROOT
from kvstrata.unified_radix_cache import EvictRequest, FullComponent, RadixKey, UnifiedRadixCache

TRACE = WORKSPACE_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
T = P = 16


class _Slots:
    """Stand-in allocator: fresh slot numbers, never runs out."""

    device = torch.device("cpu")
    size = 1 << 62

    def __init__(self) -> None:
        self.next = 0

    def available_size(self) -> int:
        return 1 << 62

    def free(self, indices: torch.Tensor) -> None:
        pass

    def take(self, n: int) -> torch.Tensor:
        self.next += n
        return torch.arange(self.next - n, self.next)


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
    slots = _Slots()
    tree = UnifiedRadixCache([FullComponent(slots)], page_size=P, eviction_policy="lru")
    cap = capacity_blocks * T
    hit = total = 0
    for tokens in keys:
        key = RadixKey(tokens)
        m = tree.match_prefix(key)
        hit += m.prefix_len
        total += len(tokens)
        if cap:
            receipt = tree.lock(m.last_node)
            excess = tree.total_size() + len(tokens) - m.prefix_len - cap
            if excess > 0:
                tree.evict(EvictRequest.full(excess))
            tree.insert(key, slots.take(len(tokens)))
            tree.unlock(receipt)
            assert tree.total_size() <= cap
        else:
            tree.insert(key, slots.take(len(tokens)))
    return 100.0 * hit / total


@pytest.mark.slow
@pytest.mark.parametrize(
    ("capacity_blocks", "expected"), [(0, 36.64), (1_000, 4.45), (10_000, 21.16), (100_000, 36.37)]
)
def test_trace_hit_rates(keys: list[array], capacity_blocks: int, expected: float) -> None:
    assert abs(_replay(keys, capacity_blocks) - expected) < 0.3
