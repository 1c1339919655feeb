"""Fixtures shared by this package's hierarchical-cache tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, Protocol

import pytest

from kvstrata.testkit.tiers import Hierarchy, Shape, make_hierarchy, serve
from kvstrata.testkit.trees import TREE_FAMILIES
from kvstrata.unified_radix_cache import FullComponent, RadixKey, TreeNode, UnifiedRadixCache
from kvstrata.unified_radix_cache.paths import node_at

_P = ParamSpec("_P")


class _Controller(Protocol):
    def close(self, timeout_s: float | None = None) -> bool: ...


class _Cache(Protocol):
    @property
    def controller(self) -> _Controller: ...


class _Built(Protocol):
    @property
    def cache(self) -> _Cache: ...


@pytest.fixture
def counting() -> Callable[[object, list[str]], Any]:
    """Wraps a compiled core so every function fetched from it is named in `calls` first."""

    def wrap(core: object, calls: list[str]) -> Any:
        class Counting:
            def __getattr__(self, name: str) -> Any:
                calls.append(name)
                return getattr(core, name)

        return Counting()

    return wrap


@pytest.fixture(params=TREE_FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    """Each device-tree family of testkit's `make_tree` in turn (Full, Full + SWA,
    Full + Mamba): a test taking `family` runs once per family."""
    return str(request.param)


@pytest.fixture
def closing() -> Iterator[list[_Built]]:
    """Hierarchies a test builds (testkit's make_*hierarchy): each test appends what it makes,
    and every tier controller is closed (its worker threads stopped) when the test ends."""
    made: list[_Built] = []
    yield made
    for h in made:
        h.cache.controller.close()


def _closed_at_teardown(
    make: Callable[_P, Hierarchy], closing: list[_Built]
) -> Callable[_P, Hierarchy]:
    def build(*args: _P.args, **kwargs: _P.kwargs) -> Hierarchy:
        h = make(*args, **kwargs)
        closing.append(h)
        return h

    return build


@pytest.fixture
def hierarchy(closing: list[_Built]) -> Callable[..., Hierarchy]:
    """testkit's `make_hierarchy` (same arguments: shape first, page size 4 by default) whose
    hierarchies are closed when the test ends (through `closing`)."""
    return _closed_at_teardown(make_hierarchy, closing)


@pytest.fixture
def full_hierarchy_of(
    closing: list[_Built],
) -> Callable[[type[UnifiedRadixCache], type[FullComponent]], Hierarchy]:
    """`full_hierarchy_of(tree_cls, full_cls)`: a Full-only hierarchy sized for testkit's
    `returning_prompts` (page 4, device 9 pages, host 16: both overflow) whose tree is a
    `tree_cls` over one `full_cls` on the system's KV allocator (subclasses whose overrides a
    test watches); closed when the test ends (through `closing`)."""
    make = _closed_at_teardown(make_hierarchy, closing)

    def build(tree_cls: type[UnifiedRadixCache], full_cls: type[FullComponent]) -> Hierarchy:
        return make(
            "full",
            page_size=4,
            device_pages=9,
            host_pages=16,
            tree=lambda system: tree_cls([full_cls(system.kv_allocator)], page_size=4),
        )

    return build


def _end_node(h: Hierarchy, tokens: list[int]) -> TreeNode:
    node = node_at(h.tree, RadixKey(tokens))
    assert node is not None, "no node ends at the served prefix"
    return node


@pytest.fixture
def served(
    hierarchy: Callable[..., Hierarchy],
) -> Callable[..., tuple[Hierarchy, list[int], TreeNode]]:
    """`served(shape, pages, **make_hierarchy_kwargs)`: a hierarchy (through `hierarchy`) that
    served one request for the prefix of `pages` pages of tokens 1, 2, ... (testkit's `serve`:
    written through to the host); returns it, that prefix and the node its run ends at."""

    def build(shape: Shape, pages: int, **kwargs: object) -> tuple[Hierarchy, list[int], TreeNode]:
        h = hierarchy(shape, **kwargs)
        prefix = list(range(1, pages * h.tiers.page_size + 1))
        serve(h, prefix)
        return h, prefix, _end_node(h, prefix)

    return build


@pytest.fixture
def offloaded(
    served: Callable[..., tuple[Hierarchy, list[int], TreeNode]],
) -> Callable[..., tuple[Hierarchy, list[int], TreeNode]]:
    """`offloaded(shape, pages, **make_hierarchy_kwargs)`: `served`, then every device page
    evicted; returns the hierarchy, the prefix (now on the host only) and its end node."""

    def build(shape: Shape, pages: int, **kwargs: object) -> tuple[Hierarchy, list[int], TreeNode]:
        h, prefix, _ = served(shape, pages, **kwargs)
        h.cache.evict_device(h.tree.evictable_size())
        return h, prefix, _end_node(h, prefix)

    return build
