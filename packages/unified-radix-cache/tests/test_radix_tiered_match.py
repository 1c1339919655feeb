"""The compiled match of a Full-only tree with a host tier (`match_tiered` in radix_core.c,
taken by `HostWalks.match`) gives the Python walk's answers: the same requests through a
`HierarchicalCache` built with the compiled core and one built inside `native.disabled()`
leave the same tree (nodes, device and host slots, access times, hit counts, locks, sizes)
and report the same hits after every step; the compiled function refuses bad nodes with an
exception; and only a Full-only tree takes it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.pool import native
from kvstrata.testkit.refusals import tree_state
from kvstrata.testkit.tiers import Hierarchy, make_hierarchy
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.native_core import native_core

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")

PAGE = 4
#: Prompts over a small alphabet in whole pages (plus the token an engine computes), so
#: prefixes are shared, devices fill and evict, and host hits and load-backs happen.
PROMPTS = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=4).map(
        lambda pages: [t for p in pages for t in [p] * PAGE] + [9]
    ),
    min_size=1,
    max_size=25,
)


def _serve(h: Hierarchy, tokens: list[int]) -> tuple[int, int, int]:
    cache = h.cache
    req = cache.begin_request(RadixKey(tokens))
    hit = req.hit
    need = -(-(len(tokens) - 1 - req.cached_len) // PAGE) * PAGE
    slots = cache.alloc_tokens(need)
    assert slots is not None
    req.extend(slots)
    cache.cache_finished_request(req)
    return hit.device_len, hit.host_len, hit.storage_len


def _picture(h: Hierarchy) -> object:
    """The testkit's `tree_state` of both tiers, less its metrics (they include seconds)."""
    return dataclasses.replace(tree_state(h.tree, h.cache), metrics=())


def _counters(h: Hierarchy) -> object:
    """The cache's transfer counters, less the seconds waited."""
    return dataclasses.replace(h.cache.counters, transfer_wait_seconds=0.0)


@needs_core
@settings(max_examples=40, deadline=None)
@given(prompts=PROMPTS)
def test_the_compiled_tiered_match_gives_the_python_answers(prompts: list[list[int]]) -> None:
    compiled = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=10)
    with native.disabled():
        python = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=10)
    assert compiled.tree._native is not None and python.tree._native is None
    try:
        for tokens in prompts:
            assert _serve(compiled, tokens) == _serve(python, tokens)
            assert _picture(compiled) == _picture(python)
            assert _counters(compiled) == _counters(python)
            compiled.cache.check_integrity()
            python.cache.check_integrity()
    finally:
        compiled.cache.controller.close()
        python.cache.controller.close()


@needs_core
@pytest.mark.parametrize(("shape", "expected"), [("full", 1), ("mamba", 0), ("swa", 0)])
def test_only_a_full_only_tiered_tree_takes_the_compiled_match(
    shape: Any, expected: int, counting: Callable[[object, list[str]], Any]
) -> None:
    h = make_hierarchy(shape, page_size=PAGE)
    try:
        assert CORE is not None
        calls: list[str] = []
        h.tree._native = counting(CORE, calls)
        tokens = [1] * PAGE + [2] * PAGE + [9]
        _serve(h, tokens)
        calls.clear()
        # (Mamba hits only where a state was cached: this engine gives none.)
        assert _serve(h, tokens)[0] == (0 if shape == "mamba" else 2 * PAGE)
        assert calls.count("match_tiered") == expected
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()


@needs_core
def test_a_host_hit_comes_back_through_the_compiled_match() -> None:
    """A prefix pushed off the device (kept on the host) matches as a host hit, with the
    device part's slots joined by the compiled call."""
    h = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=16)
    try:
        first = [1] * PAGE + [2] * PAGE + [9]
        _serve(h, first)
        h.cache.drain()
        for k in range(3, 8):  # fill the device: the first prompt's pages leave it
            _serve(h, [k] * (2 * PAGE) + [9])
            h.cache.drain()
        match = h.tree.match_prefix(RadixKey(first), max_len=len(first) - 1)
        assert (match.prefix_len, match.host_hit_len) == (0, 2 * PAGE)
        assert match.last_host_node is not None and not len(match.last_host_node.value)
        assert _serve(h, first)[:2] == (0, 2 * PAGE)  # loaded back to the device
        match = h.tree.match_prefix(RadixKey(first), max_len=len(first) - 1)
        assert (match.prefix_len, match.host_hit_len) == (2 * PAGE, 0)
        assert len(match.device_indices) == 2 * PAGE
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()


@needs_core
def test_the_compiled_tiered_match_refuses_bad_nodes_with_an_exception() -> None:
    assert CORE is not None
    h = make_hierarchy("full", page_size=2)
    try:
        tokens = [1, 2, 3, 4, 9]
        _serve(h, tokens)
        root = h.tree.root
        data = RadixKey(tokens[:4]).token_bytes()
        (leaf,) = h.tree.iter_nodes()
        good_value = leaf.value
        leaf.value = good_value[:1]
        with pytest.raises(ValueError, match="node value"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, 5)
        leaf.value = good_value
        good_key = leaf.key
        leaf.key = "not bytes"  # pyright: ignore[reportAttributeAccessIssue]
        with pytest.raises(TypeError, match="bytes"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, 5)
        leaf.key = good_key
        with pytest.raises(TypeError, match="tick"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, "5")  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError):
            CORE.match_tiered(root, 16, None, data, 32)  # pyright: ignore[reportCallIssue]
        assert CORE.match_tiered(root, 16, None, data, 0, h.tree.split_node, 5) == ([], 0, 0, None)
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()
