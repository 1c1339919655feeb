"""The hybrid (multi-component) match and insert walks of `UnifiedRadixCache`.

A tree with state components (SWA, Mamba) beside Full takes these walks instead of the
Full-only fast paths in tree.py: the same descent, plus the component hooks
(components/base.py) on every node it passes, on the new leaf and at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.results import InsertResult, MatchResult
from kvstrata.unified_radix_cache.walk import descend

if TYPE_CHECKING:
    import torch

    from kvstrata.unified_radix_cache.components.base import ComponentInsert
    from kvstrata.unified_radix_cache.tree_internals import TreeInternals

# An empty match's slots: no element to write, and numpy's storage cannot be resized.
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)


def match_hybrid(
    tree: TreeInternals, key: RadixKey, data: bytes, end: int, copy_state: bool
) -> MatchResult:
    """`match_prefix` with the component hooks: walk, cut where a component cannot restore
    its state, let components finalise (and copy) state at the last node, touch the path."""
    path = tree.walk(key.namespace, data, end)
    keep = len(path)
    for component in tree._extras:
        keep = min(keep, component.match_end(path))
    del path[keep:]
    last = path[-1] if path else tree._root
    states: dict[str, torch.Tensor] = {}
    for component in tree._extras:
        copied = component.finalize_match(last, copy_state)
        if copied is not None:
            states[component.name] = copied
    touch_path(tree, path)
    prefix_len = sum(len(n.value) for n in path)
    tree.hit_tokens += prefix_len
    slots = np.concatenate([n.value for n in path]) if path else _EMPTY_SLOTS
    if states:
        return MatchResult(prefix_len, tree._full.to_device(slots), last, states=states)
    return MatchResult(prefix_len, tree._full.to_device(slots), last)


def touch_path(tree: TreeInternals, path: list[TreeNode]) -> None:
    """One access tick on every node of `path`, with each component's access hook."""
    tree._tick += 1
    tick = tree._tick
    for node in path:
        node.last_access = tick
        node.hit_count += 1
        for component in tree._extras:
            component.on_access(node)
    if path and path[-1].heap_entry is not None:
        tree._heap.push(path[-1])


def insert_hybrid(
    tree: TreeInternals,
    key: RadixKey,
    data: bytes,
    end: int,
    slots: npt.NDArray[np.int64],
    cached_len: int,
    priority: int,
    comp_inputs: Mapping[str, ComponentInsert] | None,
) -> InsertResult:
    """`insert` with the component hooks: overlap on each existing node, new leaf, commit."""
    extras = tree._extras
    tree._tick += 1
    tick = tree._tick
    adopted: list[tuple[int, int]] = []

    def visit(node: TreeNode, at: int) -> None:
        node.last_access = tick
        if priority > node.priority:
            node.priority = priority
        start = at // TOKEN_BYTES
        for component in extras:
            component.on_access(node)
            inp = comp_inputs.get(component.name) if comp_inputs else None
            if component.on_insert_overlap(node, start, slots, inp, cached_len):
                adopted.append((start, start + len(node.value)))

    root = tree._root
    path, pos, _ = descend(root, tree._page_bytes, key.namespace, data, end, tree.split_node, visit)
    node = path[-1] if path else root
    prefix_len = pos // TOKEN_BYTES
    last = node
    if pos < end:
        last = tree.add_leaf(node, data, pos, end, slots, key.namespace, tick, priority)
        # A component may split the new leaf (SWA window boundary); `last` keeps the tail,
        # so it still ends at the key's end.
        for component in extras:
            inp = comp_inputs.get(component.name) if comp_inputs else None
            component.on_insert_new(last, prefix_len, inp)
    elif node.heap_entry is not None:
        tree._heap.push(node)
    adopted_states: tuple[str, ...] = ()
    if comp_inputs:
        adopted_states = tuple(
            c.name for c in extras if c.on_insert_commit(last, comp_inputs.get(c.name))
        )
    tree.flush_pending()
    return InsertResult(
        prefix_len,
        (end // TOKEN_BYTES) - prefix_len,
        last,
        tuple(adopted),
        adopted_states,
        cached_len,
    )
