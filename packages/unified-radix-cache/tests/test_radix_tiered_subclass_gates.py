"""The compiled tiered match (`match_tiered`) and the inline load-back's path revive
(`HostWalks.revive_path`) inline overridable steps (`tree.walk`, `HostWalks._touch`,
`tree.insert`), so, as the one-frame evictions (`host_evict.serves`), only a tree, Full
component and host tier of the exact classes take them: a subclass keeps its overrides. So
does a `HierarchicalCache` subclass's `match_prefix`, which `begin_request` skips only for the
exact class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvstrata.testkit.tiers import Hierarchy, make_hierarchy, returning_prompts, serve
from kvstrata.testkit.trees import make_full_allocator
from kvstrata.unified_radix_cache import FullComponent, HostTier, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.host_walks import HostWalks
from kvstrata.unified_radix_cache.native_core import native_core
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.results import InsertResult
from kvstrata.unified_radix_cache.tier_loads import TierLoader
from kvstrata.unified_radix_cache.tiers import TieredMatch

P = 4
needs_core = pytest.mark.skipif(native_core() is None, reason="no compiled radix core")


class _SeeingTree(UnifiedRadixCache):
    """Counts its `walk` and `insert` calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.walks = 0
        self.inserts = 0

    def walk(self, namespace: Any, data: bytes, end: int) -> list[TreeNode]:
        self.walks += 1
        return super().walk(namespace, data, end)

    def insert(self, key: RadixKey, value: Any, **kwargs: Any) -> InsertResult:
        self.inserts += 1
        return super().insert(key, value, **kwargs)


def _requests() -> list[list[int]]:
    """`returning_prompts`: more than the device or the host holds, some coming back."""
    return returning_prompts(P)


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the path revive (any tier) and load commits of an ok ack (any loader)."""
    seen = {"revive_path": 0, "loads": 0}
    revive = HostWalks.revive_path
    commit = TierLoader._commit

    def revive_spy(self: HostWalks, *args: Any) -> bool:
        seen["revive_path"] += 1
        return revive(self, *args)

    def commit_spy(self: TierLoader, pending: Any, ack: Any, node: Any) -> None:
        seen["loads"] += bool(ack.ok)
        commit(self, pending, ack, node)

    monkeypatch.setattr(HostWalks, "revive_path", revive_spy)
    monkeypatch.setattr(TierLoader, "_commit", commit_spy)
    return seen


@pytest.mark.parametrize("tree_cls", [UnifiedRadixCache, _SeeingTree])
def test_a_tree_subclass_keeps_its_walk_and_insert(
    full_hierarchy_of: Callable[[type[UnifiedRadixCache], type[FullComponent]], Hierarchy],
    monkeypatch: pytest.MonkeyPatch,
    tree_cls: type[UnifiedRadixCache],
) -> None:
    """Every tiered match of a subclass walks through its `walk`, every load-back commits
    through its `insert` (one per finished request and one per load-back); the exact classes
    revive the loaded path instead (the spy shows this test sees the difference)."""
    seen = _spy(monkeypatch)
    h = full_hierarchy_of(tree_cls, FullComponent)
    assert h.cache.controller.runs_inline
    for tokens in _requests():
        serve(h, tokens)
    loads = seen["loads"]
    assert loads > 0 and h.cache.counters.loaded_tokens > 0
    tree = h.tree
    if isinstance(tree, _SeeingTree):
        assert seen["revive_path"] == 0
        assert tree.walks >= len(_requests())
        assert tree.inserts == len(_requests()) + loads
    else:
        assert seen["revive_path"] == loads
    h.cache.check_integrity()


class _TouchingTier(HostTier):
    """Counts its `_touch` calls."""

    touches = 0

    def _touch(self, path: list[TreeNode], last: TreeNode, last_host: TreeNode | None) -> None:
        type(self).touches += 1
        super()._touch(path, last, last_host)


@needs_core
@pytest.mark.parametrize(("tier_cls", "python"), [(HostTier, False), (_TouchingTier, True)])
def test_only_the_exact_host_tier_takes_the_compiled_match(
    tier_cls: type[HostTier], python: bool
) -> None:
    """A host tier subclass matches on the Python path (its `_touch` runs); the exact class
    takes the compiled one."""
    tree = UnifiedRadixCache(
        [FullComponent(make_full_allocator(size=64, page_size=P))], page_size=P
    )
    assert tree._native is not None
    tier = tier_cls(tree, make_full_allocator(size=64, page_size=P))
    assert tier._one_frame is not python
    _TouchingTier.touches = 0
    key = RadixKey(list(range(1, 1 + 2 * P)))
    tree.match_prefix(key)
    assert _TouchingTier.touches == (1 if python else 0)


class _MatchingCache(HierarchicalCache):
    """Counts its `match_prefix` calls."""

    matches = 0

    def match_prefix(self, key: RadixKey, **kwargs: Any) -> TieredMatch:
        type(self).matches += 1
        return super().match_prefix(key, **kwargs)


@pytest.mark.parametrize(("subclass", "expected"), [(False, 0), (True, 1)])
def test_begin_request_of_a_cache_subclass_matches_through_its_match_prefix(
    closing: list[Hierarchy], subclass: bool, expected: int
) -> None:
    """`begin_request` takes the counted walk (`_match`) without building the `TieredMatch`
    only for the exact class: a subclass's `match_prefix` runs once per request, with the
    same hits."""
    h = make_hierarchy("full", page_size=P, device_pages=9, host_pages=16)
    closing.append(h)
    if subclass:
        h.cache.__class__ = _MatchingCache
    _MatchingCache.matches = 0
    tokens = list(range(1, 1 + 3 * P))
    serve(h, tokens)
    req = h.cache.begin_request(RadixKey([*tokens, 7]))
    assert req.hit.device_len == 3 * P
    assert _MatchingCache.matches == 2 * expected
    h.cache.abort_request(req)
