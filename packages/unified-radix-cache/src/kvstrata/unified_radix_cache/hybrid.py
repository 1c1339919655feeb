"""The hybrid (multi-component) match and insert walks of `UnifiedRadixCache`.

A tree with state components (SWA, Mamba) beside Full takes these walks instead of the
Full-only fast paths in tree.py: the same descent, plus the component hooks
(components/base.py) on every node it passes, on the new leaf and at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvstrata.unified_radix_cache import structure
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.results import InsertCall, InsertResult, MatchResult
from kvstrata.unified_radix_cache.walk import descend

if TYPE_CHECKING:
    import torch

    from kvstrata.unified_radix_cache.slot_checks import SlotChecker
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


def insert_slow(tree: TreeInternals, call: InsertCall, checker: SlotChecker | None) -> InsertResult:
    """`insert` on a tree with components or a host tier (`checker`: the tree's slot check,
    None when off). A Full-only tree with a host tier takes the tier's walk without hooks
    (`HostTier.insert_full`); otherwise the component walk (the tier's, which revives
    off-device nodes, or `insert_walk`), whose slot check covers every slot past `cached_len`
    (a revive or a component may adopt inside the held part) and marks the whole path held
    after."""
    tier = tree.host_tier
    if tier is not None and not tree._extras:
        return tier.insert_full(call, checker)
    if checker is not None:
        checker.check(call.slots, call.cached_len, call.end // TOKEN_BYTES)
    result = tier.insert(call) if tier is not None else insert_walk(tree, call)
    if checker is not None:
        checker.hold_path(result.last_node)
    return result


#: What an insert does with a node off the device its key runs over (a tree with a host tier:
#: `HostWalks._revive_on_insert`): `(node, start, call)`, `start` the token of the key where
#: the node begins; the node's tokens are reported adopted.
Revive = Callable[[TreeNode, int, InsertCall], None]


def insert_walk(
    tree: TreeInternals, call: InsertCall, revive: Revive | None = None
) -> InsertResult:
    """`insert` with the component hooks: overlap on each existing node, new leaf, commit. The
    one insert walk of a tree with components or a host tier: with `revive`, a node off the
    device the key runs over goes to it (instead of the overlap hooks)."""
    extras = tree._extras
    slots, cached_len, priority, inputs = call.slots, call.cached_len, call.priority, call.inputs
    tree._tick += 1
    tick = tree._tick
    adopted: list[tuple[int, int]] = []

    def visit(node: TreeNode, at: int) -> None:
        node.last_access = tick
        if priority > node.priority:
            node.priority = priority
        start = at // TOKEN_BYTES
        if revive is not None and not len(node.value):
            revive(node, start, call)
            adopted.append((start, start + node.num_tokens))
            return
        for component in extras:
            component.on_access(node)
            inp = inputs.get(component.name) if inputs else None
            if component.on_insert_overlap(node, start, slots, inp, cached_len):
                adopted.append((start, start + len(node.value)))

    namespace, end, root = call.key.namespace, call.end, tree.root
    path, pos, _ = descend(
        root, tree._page_bytes, namespace, call.data, end, tree.split_node, visit
    )
    node = path[-1] if path else root
    prefix_len = pos // TOKEN_BYTES
    if pos < end:
        node = structure.add_leaf(tree, node, call.data, pos, end, slots, namespace, tick, priority)
        # A component may split the new leaf (SWA window boundary); `node` keeps the tail,
        # so it still ends at the key's end.
        for component in extras:
            inp = inputs.get(component.name) if inputs else None
            component.on_insert_new(node, prefix_len, inp)
    elif node in tree._heap:
        tree._heap.push(node)
    if extras:
        tree.flush_pending()
    adopted_states: tuple[str, ...] = ()
    if inputs:
        adopted_states = tuple(
            c.name for c in extras if c.on_insert_commit(node, inputs.get(c.name))
        )
    return InsertResult(
        prefix_len,
        (end // TOKEN_BYTES) - prefix_len,
        node,
        tuple(adopted),
        adopted_states,
        cached_len,
    )
