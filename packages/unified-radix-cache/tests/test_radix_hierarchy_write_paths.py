"""The tiers' writes (page ids through `TierController.submit_write_pages`) give the same
state transitions whether the controller runs them on the caller's thread (a CPU group's
default) or queues them for its write worker (`run_inline=False`, the threaded path a CUDA
group takes): the same hits per request from each tier, the same host copies, the same
bytes on every load-back (testkit's `serve` checks each hit's bytes), the same counters."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvstrata.hybrid_cache import ControllerParams
from kvstrata.testkit.tiers import Hierarchy, Shape, serve
from kvstrata.unified_radix_cache import TreeNode


def host_copies(h: Hierarchy) -> list[tuple[bytes, int, list[int]]]:
    """Per node, in walk order: its key, whether it is on the device, its host slots."""
    out: list[tuple[bytes, int, list[int]]] = []
    stack: list[TreeNode] = [h.tree.root]
    while stack:
        node = stack.pop()
        if node.parent is not None:
            host = [] if node.host_value is None else np.asarray(node.host_value).tolist()
            out.append((bytes(node.key), len(node.value), host))
        stack.extend(node.children[k] for k in sorted(node.children, key=repr))
    return sorted(out)


def requests(page_size: int) -> list[list[int]]:
    """Prompts sharing prefixes, and repeats, more than the device holds: device hits, host
    hits after eviction, writes of new suffixes, host eviction (host of 32 pages)."""
    rng = np.random.default_rng(5)
    prefixes = [list(range(1 + 1000 * p, 1 + 1000 * p + 3 * page_size)) for p in range(5)]
    out = []
    for _ in range(24):
        if out and rng.random() < 0.35:  # an earlier prompt and one more page: a hit that
            earlier = out[int(rng.integers(0, len(out)))]  # a state component can restore
            out.append(earlier + rng.integers(1, 50_000, size=page_size).tolist())
            continue
        base = prefixes[int(rng.integers(0, len(prefixes)))]
        tail = rng.integers(1, 50_000, size=int(rng.integers(1, 3)) * page_size).tolist()
        out.append(base + tail)
    return out


@pytest.mark.parametrize("shape", ["full", "swa", "mamba"])
def test_inline_and_queued_writes_make_the_same_transitions(
    shape: Shape, hierarchy: Callable[..., Hierarchy]
) -> None:
    seen: dict[bool, tuple[object, ...]] = {}
    for inline in (True, False):
        h = hierarchy(shape, controller_params=ControllerParams(run_inline=inline))
        assert h.cache.controller.runs_inline is inline
        hits = [serve(h, r) for r in requests(h.tiers.page_size)]
        c = h.cache.counters
        seen[inline] = (
            hits,
            host_copies(h),
            c.device_hit_tokens,
            c.host_hit_tokens,
            c.written_tokens,
            c.bytes_d2h,
            c.bytes_h2d,
            c.writes_submitted,
            c.failed_ops,
        )
        assert c.writes_submitted > 0 and c.host_hit_tokens > 0
        h.cache.controller.check_integrity()
    assert seen[True] == seen[False]
