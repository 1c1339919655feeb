"""The one-frame evictions of `host_evict.py` against `HostTier`'s per-node loops they replace
(`_evict_device_each`, `_evict_each`): twin hierarchies served the same requests, small enough
that the device evicts and the host evicts (writes and load-backs make host room), must end
every request in the same state, and the one-frame loops must really be the ones that ran."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import pytest

from kvstrata.pool import native
from kvstrata.testkit.refusals import tree_state
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, serve
from kvstrata.unified_radix_cache import HostTier
from kvstrata.unified_radix_cache import host_tier as host_tier_module

P = 4


def _requests() -> list[list[int]]:
    """Prompts sharing prefixes, more than the device (8 pages) or the host (16) holds, some
    coming back (host hits load back, which takes device room and host locks)."""
    base = [list(range(100 * i + 1, 100 * i + 1 + 3 * P)) for i in range(6)]
    out: list[list[int]] = []
    for i, prefix in enumerate(base):
        out.append(prefix)
        out.append([*prefix, *range(1000 + 10 * i, 1000 + 10 * i + 2 * P)])
        out.append(base[i // 2])
        out.append([*base[(i + 3) % 6], *range(2000 + 10 * i, 2000 + 10 * i + 2 * P)])
    return out


@pytest.fixture(params=["compiled", "python"])
def walks(request: pytest.FixtureRequest) -> Iterator[str]:
    """With the tree's compiled core, then without it (hierarchies made inside
    `native.disabled()`, as CI's KVSTRATA_NATIVE=0 run)."""
    with nullcontext() if request.param == "compiled" else native.disabled():
        yield request.param


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tokens freed by the one-frame loops, per loop, on any tier."""
    freed = {"device": 0, "host": 0}

    def wrap(name: str, fn: Callable[[Any, int], int]) -> Callable[[Any, int], int]:
        def spied(tier: Any, amount: int) -> int:
            got = fn(tier, amount)
            freed[name] += got
            return got

        return spied

    monkeypatch.setattr(
        host_tier_module,
        "evict_device_full",
        wrap("device", host_tier_module.evict_device_full),
    )
    monkeypatch.setattr(
        host_tier_module, "evict_host_full", wrap("host", host_tier_module.evict_host_full)
    )
    return freed


def _state(h: Hierarchy) -> object:
    s = tree_state(h.tree, h.cache)
    return (s.nodes, s.components, s.lrus, s.device_heap, s.host_heap, s.host_tier, s.pools)


@pytest.mark.parametrize("events", [False, True])
def test_same_state_as_the_per_node_loops(
    closing: list[Hierarchy], monkeypatch: pytest.MonkeyPatch, walks: str, events: bool
) -> None:
    """With events the host eviction takes the per-node loop on both (it queues host events):
    the device eviction's one frame queues the same device events."""
    freed = _spy(monkeypatch)
    made = []
    for _ in range(2):
        h = make_hierarchy("full", page_size=P, device_pages=9, host_pages=16, enable_events=events)
        closing.append(h)
        made.append(h)
    fast, slow = made
    tier = slow.tree.host_tier
    assert isinstance(tier, HostTier)
    tier.evict_device = tier._evict_device_each
    tier.evict = tier._evict_each
    for tokens in _requests():
        hits = [serve(h, tokens) for h in (fast, slow)]
        assert hits[0] == hits[1]
        assert _state(fast) == _state(slow)
        assert fast.tree.num_nodes == slow.tree.num_nodes
        if events:
            assert fast.cache.take_events() == slow.cache.take_events()
    assert freed["device"] > 0
    host = fast.cache.counters.host_evicted_tokens
    assert host > 0 and host == slow.cache.counters.host_evicted_tokens
    assert freed["host"] == (0 if events else host)
